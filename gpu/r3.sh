#!/usr/bin/env bash
# Round 3 of 2026-11-28 (second session), one H200, after `source gpu/host.sh` (TE; the MBS 4 kernels restored).
#  L   local, MBS 4, fp32-master, mamba-scan: this run's baseline (median of 3 after 1 warm-up)
#  C   the same with compile_glue=true and mamba_split_in_proj=true (round 2: the fused group sums lose, 0.36x)
#  W   warm start: `nam train --recipe nam56r` at L's settings, 3 steps, after L and C filled every cache:
#      launch to first step and where it went (summary.json startup_s)
#  M2  megatron, MBS 2, TE FP8 current + te.fp8_param_gather + bf16 gradient buffers + recompute mamba: issue
#      29's memory target (< 100 GiB); builds the MBS 2 kernels first (cold)
#  F8  megatron, MBS 4, TE FP8 current + te.moe_fusion + bf16 gradient buffers + recompute mamba
# Everything lands in $OUT/r3.tgz.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-520} STEP_MIN=25 STEP_EXT=.log SUMMARY=summary.txt
R=$OUT/r3; mkdir -p "$R"; OUT0=$OUT; OUT=$R
M=(python bench/megatron.py throughput --gpus 1 --warmup 1 --iters 3)
show() { grep -E "^\|.*(local|megatron)|TrainingGuardError|OutOfMemory|Error" "$OUT/$1.log" | tail -n 3; }
LOC=(--mbs 4 --engines local --te none --recompute mamba-scan)
step 80 L "${M[@]}" "${LOC[@]}" --json "$OUT/local_mbs4.json"; show L
step 90 C "${M[@]}" "${LOC[@]}" --train-set compile_glue=true --train-set mamba_split_in_proj=true \
  --json "$OUT/local_mbs4_compile_glue_split.json"; show C
step 80 W nam train --recipe nam56r --max-steps 3 --set train.micro_batch_size=4 --set train.recompute=mamba-scan \
  --set train.checkpoint_every=0 --run-dir /tmp/r/warm --json
python -c 'import json; s=json.load(open("/tmp/r/warm/summary.json")); print({k: s.get(k) for k in ("launch_to_first_step_s", "startup_s", "first_step_s", "step_tokens_per_s")})' | tee "$OUT/W.summary.txt"
MEG=(--engines megatron --te current --recompute mamba --train-set train.grad_reduce_in_fp32=false)
step 230 M2 "${M[@]}" --mbs 2 "${MEG[@]}" --train-set te.fp8_param_gather=true --json "$OUT/megatron_mbs2_fp8_param_gather.json"
show M2
step 100 F8 "${M[@]}" --mbs 4 "${MEG[@]}" --train-set te.moe_fusion=true --json "$OUT/megatron_mbs4_fp8_moe_fusion.json"
show F8
OUT=$OUT0
tar -C "$OUT" -czf "$OUT/r3.tgz" r3 && rm -rf "${OUT:?}/r3"
log done
