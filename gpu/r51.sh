#!/usr/bin/env bash
# Round 51, 2026-11-29 (seventh session), one H200, after `source gpu/host.sh`. fwd_chunk is offered q~ k~^T and
# q~ S_in^T summed over 4 windows of 16 of each half of n (`NWIN` 4, a loop; the two windows past NAM56R's 32 angles
# are not rotated): offline 180 registers (168 capped, 28 B of spills: three programs an SM) and 2,200 SASS
# instructions against 249 / 2,584 in one window.
#  MK   gpu/mimo_kernels.py (per launch; fwd_chunk's tuner times)
#  MP8  the GPU parity test at ngroups 8 (bf16 against the fp32 reference, l=1000)
# Result (ran at commit b38d769): 4 windows 3.76 ms (3.07 capped) against 2.40 in one window; reverted (8fb4ea1).
set -u
TOP=$OUT OUT=$OUT/r51 && mkdir -p "$OUT"  # only $TOP/r51.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-200} STEP_MIN=15 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|first|digest|tuned fwd_chunk)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 80 MK python gpu/mimo_kernels.py; show MK 16
step 100 MP8 python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider \
  -k "nam56r_widths and 8-None"; show MP8 4
tar -C "$TOP" -czf "$TOP/r51.tgz" r51 && rm -rf "$OUT"
