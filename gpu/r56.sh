#!/usr/bin/env bash
# Round 56, 2026-11-29 (eighth session), one H200, after `source gpu/host.sh`: L1 prefetches in the dq / dk
# windows (r46's stall samples by line, SASS unchanged since: the per-head bias loads 25% / 22% of dq's / dk's,
# the cos / sin table's repeat over the ranks 14% / 3%, dk's load of dq's d phase 6%).
#  MK0  NAM_MIMO_PREFETCH=0: r55's code
#  MK1  the next head's q / k bias lines (and dk: this head's d phase) prefetched into L1 (prefetch.global.L1)
#  MK2  MK1 + NAM_MIMO_TABLE_PF=1: the table read per (token, rank) row, the next head's lines prefetched,
#       in place of the per-token table held a head ahead and repeated over the ranks
#  MK3  NAM_MIMO_TABLE_PF=1 alone
#  (the four digests must agree: a prefetch and a row read change no value)
#  NCU  Nsight Compute over the backward's three passes (MK1's code), for the per-head pass's lines at its cap
# Result: MK1 dq 2.52 / dk 2.88 ms against MK0's 2.68 / 2.81; the per-row table (MK2, MK3) slower: dq 3.09 / 3.04,
# dk 3.23 / 3.21; the four digests equal. NCU: the per-head pass at 18.75% occupancy (168 registers).
set -u
TOP=$OUT OUT=$OUT/r56 && mkdir -p "$OUT"  # only $TOP/r56.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-420} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(fwd|launch|first|digest)|passed|failed|FAILED|rror" "$OUT/$1.log" | tail -n "${2:-12}" \
  | tee -a "$OUT/$SUMMARY"; }
step 60 MK0 env NAM_MIMO_PREFETCH=0 python gpu/mimo_kernels.py; show MK0 10
step 60 MK1 python gpu/mimo_kernels.py; show MK1 10
step 60 MK2 env NAM_MIMO_TABLE_PF=1 python gpu/mimo_kernels.py; show MK2 10
step 60 MK3 env NAM_MIMO_PREFETCH=0 NAM_MIMO_TABLE_PF=1 python gpu/mimo_kernels.py; show MK3 10
ncu_profile NCU "bwd_kernel" 3 150 python gpu/mimo_ncu.py
tar -C "$TOP" -czf "$TOP/r56.tgz" r56 && rm -rf "$OUT"
