#!/usr/bin/env bash
# Round 68, 2026-12-07 (eleventh session), one GPU, after `source gpu/host.sh`, with r66's kernel cache (H100 builds).
#  T     the plugin's GPU tests, the 11th (kept states and the mamba-scan replay bit for bit, written last session)
#        among them for the first time
# gpu/r68b.sh, the next call on the same machine, times the scan at b4.
# Result (H200, ran BUDGET=330): T 11 passed in 223 s, the kept-states / replay test among them.
set -u
TOP=$OUT OUT=$OUT/r68 && mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-330} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\| |passed|failed|^FAILED|^ERROR|rror|Traceback" "$OUT/$1.log" | head -n "${2:-30}" | tee -a "$OUT/$SUMMARY"; }
step 300 T python -m pytest -m gpu -q -rA plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py; show T
OUT=$TOP kcache_pack
tar -C "$TOP" -czf "$TOP/r68.tgz" r68 && rm -rf "$OUT"
