#!/usr/bin/env bash
# Round 23 (2026-11-28, seventh session), one H200, after `source gpu/host.sh`:
#  MF  megatron, TE FP8 current, te.moe_fusion, bf16-moments, mamba-scan, MBS 4, the hopper-ce head (now the
#      recipe's, gradients in forward): issue 29's FP8 row against r22's bf16 row of the same engine (10,391)
#  FL  bench/float8_loss.py --te-only --seeds 3: bf16 and TE's FP8 linears (current, delayed) on the tiny model,
#      200 steps, three seeds each, nine runs side by side: the TE rows against bf16's spread over the seeds
# Everything lands in $OUT/r23.tgz.
set -u
TOP=$OUT OUT=$OUT/r23 && mkdir -p "$OUT"  # only $TOP/r23.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-550} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(local|megatron)|verdict|within|PASS|FAIL|mean of|per seed|against bf16|wall|TrainingGuardError|OutOfMemory|Error" "$OUT/$1.log" | tail -n 14 | tee -a "$OUT/$SUMMARY"; }
# r23 ran: MF 11,148 tokens/s; FL stopped: te delayed's final save (refit_mirror since)
step 130 MF python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3 --recompute mamba-scan \
  --engines megatron --numerics bf16-moments --te current --train-set te.moe_fusion=true \
  --json "$OUT/megatron_hopper_ce_fp8.json"; show MF
step 420 FL python bench/float8_loss.py --te-only --seeds 3 --json "$OUT/float8_loss_te_3seeds.json"; show FL
tar -C "$TOP" -czf "$TOP/r23.tgz" r23 && rm -rf "$OUT"
