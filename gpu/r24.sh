#!/usr/bin/env bash
# Round 24 (2026-11-28, seventh session), one H200, after `source gpu/host.sh`: r23's FL again. There the three
# `te delayed` runs stopped at their final save (the host mirror of the checkpoint was built from step 0's state;
# TE's `_extra_state` had grown since: async_checkpoint.refit_mirror now refits it), and the script exits on any
# failed run, so nothing came back. bf16 and TE's FP8 linears (current, delayed), tiny model, 200 steps, 3 seeds.
set -u
TOP=$OUT OUT=$OUT/r24 && mkdir -p "$OUT"  # only $TOP/r24.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-300} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "verdict|within|PASS|FAIL|mean of|per seed|against bf16|wall|Error" "$OUT/$1.log" | tail -n 14 | tee -a "$OUT/$SUMMARY"; }
step 280 FL python bench/float8_loss.py --te-only --seeds 3 --json "$OUT/float8_loss_te_3seeds.json"; show FL
tar -C "$TOP" -czf "$TOP/r24.tgz" r24 && rm -rf "$OUT"
