#!/usr/bin/env bash
# Round 4 of 2026-11-28 (second session; the session's last 220 s of device time), one H200, after
# `source gpu/host.sh` with round 3's kernel caches (they hold the MBS 2 kernels):
#  M2F megatron, MBS 2, TE FP8 current, train.fused_master_weights (fp32 gradient buffers), recompute mamba:
#      issue 29's MBS 2 memory (round 3's row with te.fp8_param_gather and bf16 gradient buffers went non-finite
#      at step 1)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-120} STEP_MIN=25 STEP_EXT=.log SUMMARY=summary.txt
step 118 M2F python bench/megatron.py throughput --gpus 1 --warmup 1 --iters 2 --mbs 2 --engines megatron --te current \
  --recompute mamba --train-set train.fused_master_weights=true --json "$OUT/megatron_mbs2_fp8_fused.json"
grep -E "^\|.*megatron|TrainingGuardError|OutOfMemory|Error" "$OUT/M2F.log" | tail -n 3
