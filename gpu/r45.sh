#!/usr/bin/env bash
# Round 45, 2026-11-29 (sixth session), one H200, after `source gpu/host.sh`: the mimo-scan plugin's GPU tests on
# r44's code (r42 cut the ninth at 330 s, so the step has the round's whole budget), then the kernel caches packed
# for the next round.
set -u
TOP=$OUT OUT=$OUT/r45 && mkdir -p "$OUT"  # only $TOP/r45.tgz (and kcache.tgz) come back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
step $((BUDGET - 40)) MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v \
  -p no:cacheprovider --durations 0
grep -E "passed|failed|FAILED|rror|^[0-9.]+s " "$OUT/MP.log" | tail -n 30 | tee -a "$OUT/$SUMMARY"
OUT=$TOP kcache_pack
tar -C "$TOP" -czf "$TOP/r45.tgz" r45 && rm -rf "$OUT"
