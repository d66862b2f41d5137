#!/usr/bin/env bash
# Round for issue 29 part 2 on two GPUs of one host (nvidia-h200-x2), after `source gpu/host.sh`; carries
# .device-deepep (plugins/nam-plugin-deepep/device/fetch-deepep.sh) and, to skip the compile, .deepep-cache.
# What the plugin README lists as left for a host with several GPUs, at 2 ranks:
#  build  DeepEP 1.2.1 (or restore it), into /tmp/site
#  probes ranks-on-gpus 2 and megatron-flex-on-gpus 2: rank r on cuda:r, an NCCL group, DeepEP's kernels over
#         NVLink, directly and through Megatron's flex dispatcher, against the references of the one-GPU probes
#  pre    nam preflight --plugins deepep --ep 2 --nproc 2 (peer access between the two GPUs)
#  tiny   nam56r-tiny, megatron, EP 2, 8 steps, alltoall vs flex (DeepEP): the same losses within bf16 noise
#  full   full NAM56R, megatron, EP 2, MBS 4, mamba recompute, 6 steps, alltoall vs flex: tokens/s, peak memory
# Everything lands in $OUT/deepep2.tgz (one file: a round returns at most 8).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-500} STEP_MIN=15 STEP_EXT=.log SUMMARY=summary.txt STEP_TAIL=4
R=$OUT/deepep2; mkdir -p "$R" .deepep-cache
OUT0=$OUT; OUT=$R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/gpu.txt"
nvidia-smi topo -m >> "$R/gpu.txt" 2>&1
cp plugins/nam-plugin-deepep/device/install-deepep.sh .device-deepep/
step 200 build env MAX_JOBS=32 bash .device-deepep/install-deepep.sh .deepep-cache
cp .deepep-cache/deep_ep_cpp-*.so.xz "$OUT0/" 2>/dev/null
P=plugins/nam-plugin-deepep/device/probe_deepep.py
step 60 ranks-on-gpus python $P ranks-on-gpus 2
step 90 megatron-flex-on-gpus python $P megatron-flex-on-gpus 2
step 60 preflight nam preflight --recipe nam56r-tiny --device cuda --engine megatron --plugins deepep --ep 2 --set attention_backend=reference --set train.dtype=bfloat16 \
  --nproc 2 --json
T=(nam train --recipe nam56r-tiny --device cuda --engine megatron --nproc 2 --ep 2 --max-steps 8 --seed 7
   --set train.log_every=1 --set attention_backend=reference --set train.dtype=bfloat16)
step 70 tiny-alltoall "${T[@]}" --run-dir /tmp/r/tiny-a2a
step 70 tiny-flex "${T[@]}" --plugins deepep --run-dir /tmp/r/tiny-flex
F=(nam train --recipe nam56r --engine megatron --nproc 2 --ep 2 --max-steps 6 --seed 7 --set train.log_every=1
   --set train.micro_batch_size=4 --set train.recompute=mamba --set train.checkpoint_every=0)
step 150 full-alltoall "${F[@]}" --run-dir /tmp/r/full-a2a
step 150 full-flex "${F[@]}" --plugins deepep --run-dir /tmp/r/full-flex
collect_runs /tmp/r "$R/runs"
OUT=$OUT0
tar -C "$OUT" -czf "$OUT/deepep2.tgz" deepep2 && rm -rf "${OUT:?}/deepep2"
log done
