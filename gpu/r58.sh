#!/usr/bin/env bash
# Round 58, 2026-11-29 (eighth session), one H200, after `source gpu/host.sh`: the session's final code (the bias
# prefetch in both dq and dk, no switch: the same SASS as r57's MKD, checked offline).
#  MK   gpu/mimo_kernels.py (its digest against r55-r57's 85d88b6746c5ee36)
#  MP   the plugin's GPU tests (r57's run reached the last test at its 220 s limit)
# Result: fwd+bwd 17.38 ms (dq 2.53, dk 2.80), digest 85d88b6746c5ee36; the GPU tests 10 passed (239 s).
set -u
TOP=$OUT OUT=$OUT/r58 && mkdir -p "$OUT"  # only $TOP/r58.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-380} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(fwd|launch|first|digest)|passed|failed|FAILED|rror" "$OUT/$1.log" | tail -n "${2:-12}" \
  | tee -a "$OUT/$SUMMARY"; }
step 50 MK python gpu/mimo_kernels.py; show MK 10
step 320 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider \
  --durations=0
show MP 30
tar -C "$TOP" -czf "$TOP/r58.tgz" r58 && rm -rf "$OUT"
