#!/usr/bin/env bash
# Round 61, 2026-11-29 (ninth session), one H200, after `source gpu/host.sh`: the session's final code (r60's
# prefetch in the phase and time_grads walks, no switch).
#  MK   gpu/mimo_kernels.py (its digest against r55-r60's 85d88b6746c5ee36)
#  MKC  fwd_chunk also offered 4 warps capped at 128 registers (520 B of spills offline; four programs an SM)
#  MB   bench/mimo_scan.py: mamba-ssm's static kernels and nam's in one run, both profiled
#  MP   the plugin's GPU tests
# Result: fwd+bwd 17.14 ms (phase 0.189, time_grads 0.197), digest 85d88b6746c5ee36; fwd_chunk capped at 128 2.59
# against 1.94; same run: mamba-ssm's static 15.65 ms, mimo-scan 17.45 (0.90x); the GPU tests 10 passed (235 s).
set -u
TOP=$OUT OUT=$OUT/r61 && mkdir -p "$OUT"  # only $TOP/r61.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(mamba-ssm|mimo-scan)|^(fwd|launch|first|digest|tuned fwd_chunk)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 50 MK python gpu/mimo_kernels.py; show MK 11
step 45 MKC python gpu/mimo_kernels.py --chunk-configs 4,1,168 4,1,128; show MKC 13
step 150 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 140 --json "$OUT/mimo_scan_vs_static.json" --profile "$OUT/prof"; show MB 6
step 300 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider \
  --durations=0
show MP 30
tar -C "$TOP" -czf "$TOP/r61.tgz" r61 && rm -rf "$OUT"
