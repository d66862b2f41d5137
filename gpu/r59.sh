#!/usr/bin/env bash
# Round 59, 2026-11-29 (ninth session), one H200, after `source gpu/host.sh`: L1 prefetch of the next step's lines
# in every walk along the sequence (r46's ncu: the walks' largest stall is long_sb, 41-43% of their samples), and
# fwd_chunk over CPP chunks a program, the next chunk's lines prefetched (NAM_MIMO_WALK_PF switches both).
#  MK1  gpu/mimo_kernels.py, the prefetches on (the tuner times fwd_chunk at CPP 1, 2, 4)
#  MK0  NAM_MIMO_WALK_PF=0: no prefetch in the walks, phase, time_grads, nor in fwd_chunk's loop
#  MKW  the walks also at PSPLIT 2 with 1 stage (prefetch on)
#  (the digests must agree: a prefetch changes no value)
#  NCU  Nsight Compute over the forward's state walk and fwd_chunk and the backward's walks (MK1's code)
# Result: slower with the prefetch: state walk 1.014 -> 1.077 ms, dstate walk 1.351 -> 1.463 (MK0 -> MK1; ncu: spill
# stores and loads 13% / 24% of the walks' stall samples); fwd_chunk at CPP 2 / 4 2.15 / 2.10 (2.26 / 2.12 without the
# prefetch) against 1.90 at CPP 1; phase 0.256 -> 0.191. PSPLIT 2 at 1 stage: state walk 1.22, dstate walk 1.57
# against 1.08 / 1.47. The three digests equal (85d88b6746c5ee36).
set -u
TOP=$OUT OUT=$OUT/r59 && mkdir -p "$OUT"  # only $TOP/r59.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-300} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(fwd|launch|first|digest|tuned (state_walk|dstate_walk|fwd_chunk))|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-20}" | tee -a "$OUT/$SUMMARY"; }
step 70 MK1 python gpu/mimo_kernels.py; show MK1 20
step 60 MK0 env NAM_MIMO_WALK_PF=0 python gpu/mimo_kernels.py; show MK0 20
step 50 MKW python gpu/mimo_kernels.py --walk-configs 4,1 4,1,2; show MKW 20
ncu_profile NCU "state_walk_kernel|fwd_chunk_kernel" 4 90 python gpu/mimo_ncu.py
tar -C "$TOP" -czf "$TOP/r59.tgz" r59 && rm -rf "$OUT"
