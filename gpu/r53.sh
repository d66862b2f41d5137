#!/usr/bin/env bash
# Round 53, 2026-11-29 (seventh session), one H200, after `source gpu/host.sh`: the session's final code. r50: the
# phase kernel with cos.approx / sin.approx of the reduced phase 0.381 -> 0.257 ms a call; r52: the cos / sin table
# read per (token, rank) row in the state walk, fwd_chunk (now capped at 168 registers: three programs an SM) and
# the per-head pass, fwd+bwd 18.89 -> 18.33 in one run.
#  MK   gpu/mimo_kernels.py (per launch, fwd+bwd)
#  MB   bench/mimo_scan.py: mamba-ssm's static kernels and nam's in one run, both profiled
#  MP   the plugin's GPU tests
# Result: fwd+bwd 18.31 ms; the static row's TileLang build ran past the step's 180 s (no ratio); the GPU tests 10
# passed (245 s).
set -u
TOP=$OUT OUT=$OUT/r53 && mkdir -p "$OUT"  # only $TOP/r53.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-520} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(mamba-ssm|mimo-scan)|^(fwd|launch|first|digest)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 70 MK python gpu/mimo_kernels.py; show MK 12
step 190 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 180 --json "$OUT/mimo_scan_vs_static.json" --profile "$OUT/prof"; show MB 6
step 260 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 16
tar -C "$TOP" -czf "$TOP/r53.tgz" r53 && rm -rf "$OUT"
