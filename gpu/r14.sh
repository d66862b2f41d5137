#!/usr/bin/env bash
# Round 14 (2026-11-28, fifth session), one H200, after `source gpu/host.sh`: issue 29's FP8 loss rows.
#  FL  bench/float8_loss.py --te: the tiny model 200 steps in bf16, torchao FP8 (both parts, each part alone),
#      bf16 with the next seed, and Transformer Engine's FP8 linears (current and delayed scaling), side by side
# Everything lands in $OUT/r14.tgz.
set -u
TOP=$OUT OUT=$OUT/r14 && mkdir -p "$OUT"  # only $TOP/r14.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-480} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt STEP_TAIL=16
step 450 FL python bench/float8_loss.py --te --json "$OUT/float8_loss_te.json"
tar -C "$TOP" -czf "$TOP/r14.tgz" r14 && rm -rf "$OUT"
