#!/usr/bin/env bash
# Round 57, 2026-11-29 (eighth session), one H200, after `source gpu/host.sh`: the session's code (the per-head pass
# capped at 168 registers, r55) with the L1 prefetch of the next head's bias lines, by NAM_MIMO_PREFETCH (r56: dq
# 2.68 -> 2.52 ms, dk 2.81 -> 2.88 with the prefetch in both, d phase's lines included for dk).
#  MKQ  gpu/mimo_kernels.py, the prefetch in the dq pass only (NAM_MIMO_PREFETCH=dq, the default)
#  MK0  none (NAM_MIMO_PREFETCH=0)
#  MKD  in both dq and dk, the bias lines only (NAM_MIMO_PREFETCH=dqdk)
#  (the three digests must agree)
#  MB   bench/mimo_scan.py: mamba-ssm's static kernels and nam's in one run, both profiled
#  MP   the plugin's GPU tests
# Result: dq 2.50 (MKQ) / 2.66 (MK0) / 2.51 (MKD); dk 2.81 / 2.81 / 2.80; the digests equal. Same run: mamba-ssm's
# static 15.99 ms, mimo-scan 17.60 (0.91x). MP cut at its 220 s limit in its last test (the first nine passed).
set -u
TOP=$OUT OUT=$OUT/r57 && mkdir -p "$OUT"  # only $TOP/r57.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(mamba-ssm|mimo-scan)|^(fwd|launch|first|digest)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 50 MKQ python gpu/mimo_kernels.py; show MKQ 10
step 50 MK0 env NAM_MIMO_PREFETCH=0 python gpu/mimo_kernels.py; show MK0 10
step 50 MKD env NAM_MIMO_PREFETCH=dqdk python gpu/mimo_kernels.py; show MKD 10
step 230 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 220 --json "$OUT/mimo_scan_vs_static.json" --profile "$OUT/prof"; show MB 6
step 220 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 16
tar -C "$TOP" -czf "$TOP/r57.tgz" r57 && rm -rf "$OUT"
