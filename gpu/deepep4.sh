#!/usr/bin/env bash
# Round for issue 29 part 2 on four GPUs of one host (nvidia-h200-x4), after `source gpu/host.sh`; carries
# .device-deepep (plugins/nam-plugin-deepep/device/fetch-deepep.sh), .deepep-cache (the extension built on the
# x2 host: DeepEP 1.2.1, NVSHMEM off, sm_90, torch 2.11.0+cu130) and .kcache, not
# .device-te (a run carries 64 MiB). gpu/deepep2.sh's round at 4 ranks:
#  build  restore DeepEP into /tmp/site (or build it)
#  probes ranks-on-gpus 4 and megatron-flex-on-gpus 4: DeepEP's kernels over NVLink between 4 ranks, directly and
#         through Megatron's flex dispatcher, against the probes' references
#  pre    nam preflight --plugins deepep --ep 4 --nproc 4 (peer access between every ordered pair)
#  full   full NAM56R, megatron, EP 4 (DP 4), MBS 4, mamba recompute, bf16, 6 steps, alltoall vs flex (DeepEP):
#         tokens/s per GPU, peak memory, the LM losses side by side
#  tiny   nam56r-tiny, megatron, EP 4, 8 steps, alltoall vs flex: the same losses within bf16 noise
# Everything lands in $OUT/deepep4.tgz.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-545} STEP_MIN=15 STEP_EXT=.log SUMMARY=summary.txt STEP_TAIL=4
R=$OUT/deepep4; mkdir -p "$R" .deepep-cache
OUT0=$OUT; OUT=$R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/gpu.txt"
nvidia-smi topo -m >> "$R/gpu.txt" 2>&1
cp plugins/nam-plugin-deepep/device/install-deepep.sh .device-deepep/
step 200 build env MAX_JOBS=60 bash .device-deepep/install-deepep.sh .deepep-cache
P=plugins/nam-plugin-deepep/device/probe_deepep.py
step 60 ranks-on-gpus python $P ranks-on-gpus 4
step 90 megatron-flex-on-gpus python $P megatron-flex-on-gpus 4
step 60 preflight nam preflight --recipe nam56r-tiny --device cuda --engine megatron --plugins deepep --ep 4 \
  --set attention_backend=reference --set train.dtype=bfloat16 --nproc 4 --json
F=(nam train --recipe nam56r --engine megatron --nproc 4 --ep 4 --max-steps 6 --seed 7 --set train.log_every=1
   --set train.micro_batch_size=4 --set train.recompute=mamba --set train.checkpoint_every=0)
step 150 full-alltoall "${F[@]}" --run-dir /tmp/r/full-a2a
step 150 full-flex "${F[@]}" --plugins deepep --run-dir /tmp/r/full-flex
T=(nam train --recipe nam56r-tiny --device cuda --engine megatron --nproc 4 --ep 4 --max-steps 8 --seed 7
   --set train.log_every=1 --set attention_backend=reference --set train.dtype=bfloat16)
step 60 tiny-alltoall "${T[@]}" --run-dir /tmp/r/tiny-a2a
step 60 tiny-flex "${T[@]}" --plugins deepep --run-dir /tmp/r/tiny-flex
collect_runs /tmp/r "$R/runs"
OUT=$OUT0
tar -C "$OUT" -czf "$OUT/deepep4.tgz" deepep4 && rm -rf "${OUT:?}/deepep4"
log done
