#!/usr/bin/env bash
# Round 29 (prepared 2026-11-29, NOT YET RUN: the session's device time was spent), one H200, after
# `source gpu/host.sh`. nam's MIMO scan with the backward's wider autotune list (kernels.CONFIGS["bwd"]: 8, 4, 16
# warps and 8 warps with 2 stages; r28 measured it through --bwd-configs only):
#  MP  the plugin's GPU tests in full: bf16 parity at NAM56R's widths with whichever configs the tuner now picks,
#      no host sync, capture, first call, preflight
#  MK  gpu/mimo_kernels.py: per-launch ms and, new, the config chosen for each pass (which of 4 or 16 warps the
#      per-head pass takes)
#  MB  bench/mimo_scan.py, mamba-ssm static against mimo-scan in one run
# Everything lands in $OUT/r29.tgz.
set -u
TOP=$OUT OUT=$OUT/r29 && mkdir -p "$OUT"  # only $TOP/r29.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-500} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(mamba-ssm|mimo-scan)|^(fwd|launch|  chosen)|passed|failed|FAILED|Error" "$OUT/$1.log" \
  | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 200 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -q -s -p no:cacheprovider; show MP 30
step 120 MK python gpu/mimo_kernels.py; show MK 20
step 120 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 100 --json "$OUT/mimo_scan_vs_static.json"; show MB 4
tar -C "$TOP" -czf "$TOP/r29.tgz" r29 && rm -rf "$OUT"
