#!/usr/bin/env bash
# A record of what ran: --fs (mimo_kernels.py) was removed after this round with the FS 0 variant (the same
# time: 6.785 against 6.782 ms for the per-head pass), so the script no longer runs as it stands; the digest
# line failed in this round (a tensor that required grad), fixed since.
# Round 39 (2026-11-29, fourth session), one H200, after `source gpu/host.sh`. r37's Nsight Compute profile of the
# per-head pass, attributed to source lines offline (gpu/ncu_lines.py over r37's SASS page and the same build
# disassembled here): ~27% of its stall samples sit in the cross-warp and cross-lane sums (shuffles, barriers) of
# the column blocks. Now sums that share an axis are one tl.reduce (the bwd kernel's FS, default 1; offline,
# sm_90, 4 warps 2 stages: the per-head pass 56 -> 47 barriers, 32 -> 0 B of spills; dq / dk 34 -> 31 barriers).
#  MK   gpu/mimo_kernels.py as committed (FS 1): per-pass times, and a digest of every result
#  MK0  the same with --fs 0 (one reduction a sum): the before, same machine; the digests should match
#  MP   the plugin's GPU tests (bf16 parity at ngroups 1, 8, 128 and 32-token tiles; capture; tuning; preflight)
set -u
TOP=$OUT OUT=$OUT/r39 && mkdir -p "$OUT"  # only $TOP/r39.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|block_t|digest)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 110 MK python gpu/mimo_kernels.py; show MK 40
step 110 MK0 python gpu/mimo_kernels.py --fs 0; show MK0 40
step 250 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 12
tar -C "$TOP" -czf "$TOP/r39.tgz" r39 && rm -rf "$OUT"
