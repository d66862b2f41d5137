#!/usr/bin/env bash
# Round of 2026-11-28 (second session), one H200, after `source gpu/host.sh` (TE installed; the MBS 4 kernels
# restored from .kcache). Every row: full NAM56R, MBS 4, median of 3 steps after 1 warm-up.
#  P   megatron, TE bf16, Megatron's fp32 masters, bf16 gradient buffers, recompute mamba, with a profile
#      (issue 29: where the megatron engine's time goes; last round's profile did not come back)
#  PF  the same with te.moe_fusion=true (TE's fused router and token permutation)
#  glue  bench/glue.py: each glue region eager against compiled / fused (issue 32 item 3)
#  G   local, fp32-master, mamba-scan, the glue on: compile_glue, mamba-ssm.group_sums=fused, mamba_split_in_proj
#  L   local, fp32-master, mamba-scan: the same run's baseline for G
# Everything lands in $OUT/r2.tgz (a round returns at most 8 files).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-520} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
R=$OUT/r2; mkdir -p "$R"; OUT0=$OUT; OUT=$R
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3)
show() { grep -E "^\|.*(local|megatron)|TrainingGuardError|OutOfMemory|Error" "$OUT/$1.log" | tail -n 3; }
MEG=(--engines megatron --te off --recompute mamba --train-set train.grad_reduce_in_fp32=false)
step 130 P "${M[@]}" "${MEG[@]}" --profile "$OUT/profiles" --json "$OUT/megatron_mbs4_te_bf16.json"; show P
step 100 PF "${M[@]}" "${MEG[@]}" --train-set te.moe_fusion=true --json "$OUT/megatron_mbs4_te_bf16_moe_fusion.json"
show PF
step 80 glue python bench/glue.py --json "$OUT/glue.json"; tail -n 12 "$OUT/glue.log"
LOC=(--engines local --te none --recompute mamba-scan)
step 100 G "${M[@]}" "${LOC[@]}" --train-set compile_glue=true --train-set mamba-ssm.group_sums=fused \
  --train-set mamba_split_in_proj=true --json "$OUT/local_mbs4_glue.json"; show G
step 90 L "${M[@]}" "${LOC[@]}" --json "$OUT/local_mbs4.json"; show L
OUT=$OUT0
tar -C "$OUT" -czf "$OUT/r2.tgz" r2 && rm -rf "${OUT:?}/r2"
log done
