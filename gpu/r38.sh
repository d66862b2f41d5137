#!/usr/bin/env bash
# A record of what ran: --no-hand-dy (mimo_kernels.py, mimo_fault.py) was removed after this round with the variant they tried (measured
# slower), so the script no longer runs as it stands.
# Round 38 (2026-11-29, third session), one H200, after `source gpu/host.sh`. r37: dq and dk in one launch took
# 10.1 ms against 6.2 for the two (dropped); the per-head pass's warps wait on global loads (long_sb 26%, STS 14%
# of samples, 12.5% occupancy). Now: the per-head pass may skip handing dy to dq (scan.HAND_DY False), dq forming it
# again from dout and z (offline, sm_90: the per-head pass at 4 warps 2 stages 255 -> 236 registers, 20 -> 0 B of
# spills, 5,384 -> 4,632 SASS instructions, and 1.07 GB less written at b2):
#  MK   gpu/mimo_kernels.py as committed (dy handed over)
#  MKN  the same with --no-hand-dy
#  MFN  --no-hand-dy against the reference: the per-head pass at 4 warps 2 stages, dq at 4 warps 1 stage and at
#       2 windows 4 warps 2 stages, 16- and 32-token tiles
set -u
TOP=$OUT OUT=$OUT/r38 && mkdir -p "$OUT"  # only $TOP/r38.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-280} STEP_MIN=15 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|block_t)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 70 MK python gpu/mimo_kernels.py; show MK 40
step 70 MKN python gpu/mimo_kernels.py --no-hand-dy; show MKN 40
for c in "CHUNK 4 2 1" "DQ 4 1 1" "DQ 4 2 2"; do
  for bt in 16 32; do
    set -- $c
    step 30 "MFN_$1_$2_$3_$4_$bt" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py $2 $3 --pass $1 --ns $4 \
      --block-t $bt --no-hand-dy; show "MFN_$1_$2_$3_$4_$bt" 2
  done
done
tar -C "$TOP" -czf "$TOP/r38.tgz" r38 && rm -rf "$OUT"
