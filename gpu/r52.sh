#!/usr/bin/env bash
# Round 52, 2026-11-29 (seventh session), one H200, after `source gpu/host.sh`. The cos / sin table read per
# (token, rank) row (`NAM_MIMO_TABLE_ROWS=1`: each row loads its token's row, L1 hits) against once per token and
# repeated over the ranks in registers (r32's, through shared memory), in the kernels that read it through
# `_cos_sin` (the state walk, fwd_chunk, the per-head pass): offline fwd_chunk 248 -> 188 registers (capped at 168:
# 64 B of spills against 548, so three programs an SM), the per-head pass 252 -> 247. fwd_chunk is offered the
# 168-register cap in both runs.
#  MK0  gpu/mimo_kernels.py, the table per token (as committed)
#  MK1  the same, per row
# Result (ran at commit 894c3a5): per row fwd+bwd 18.33 against 18.89 (state walk 1.03 / 1.08, fwd_chunk 1.97 capped /
# 2.25, per-head 5.73 / 5.83); per row made the only way (a3094ba), the switch gone.
set -u
TOP=$OUT OUT=$OUT/r52 && mkdir -p "$OUT"  # only $TOP/r52.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-200} STEP_MIN=15 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|first|digest|tuned (fwd_chunk|state_walk))|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-18}" | tee -a "$OUT/$SUMMARY"; }
step 80 MK0 python gpu/mimo_kernels.py --chunk-configs 4,1 8,1 4,1,168; show MK0
step 80 MK1 env NAM_MIMO_TABLE_ROWS=1 python gpu/mimo_kernels.py --chunk-configs 4,1 8,1 4,1,168; show MK1
tar -C "$TOP" -czf "$TOP/r52.tgz" r52 && rm -rf "$OUT"
