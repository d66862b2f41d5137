#!/usr/bin/env bash
# Round 60, 2026-11-29 (ninth session), one H200, after `source gpu/host.sh`: r59's prefetch kept where it paid
# (the phase walk: 0.256 -> 0.191 ms), also in time_grads, by NAM_MIMO_TIME_PF; the walks' own launch settings.
#  MK1  gpu/mimo_kernels.py, phase and time_grads prefetching their next block's lines into L1
#  MK0  NAM_MIMO_TIME_PF=0: neither (the digests must agree)
#  PS   gpu/phase_sweep.py: phase and time_grads at 64 / 128 / 256 tokens a step, 4 / 8 warps (prefetch on)
# Result: MK1 against MK0: phase 0.191 / 0.256 ms, time_grads 0.197 / 0.247, fwd+bwd 17.17 / 17.34; the digests equal.
# PS: no step length or warp count clearly faster than the launched 64 tokens at 4 warps (phase 0.194-0.254 ms,
# time_grads 0.192-0.291, standalone), and any other step length sums in another order: kept.
set -u
TOP=$OUT OUT=$OUT/r60 && mkdir -p "$OUT"  # only $TOP/r60.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-200} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(fwd|launch|first|digest|phase|time_grads)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-20}" | tee -a "$OUT/$SUMMARY"; }
step 60 MK1 python gpu/mimo_kernels.py; show MK1 12
step 50 MK0 env NAM_MIMO_TIME_PF=0 python gpu/mimo_kernels.py; show MK0 12
step 50 PS python gpu/phase_sweep.py; show PS 14
tar -C "$TOP" -czf "$TOP/r60.tgz" r60 && rm -rf "$OUT"
