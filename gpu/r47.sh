#!/usr/bin/env bash
# Round 47, 2026-11-29 (sixth session), one H200, after `source gpu/host.sh`. r46's profile of nam's fwd+bwd at b2
# (torch.profiler, 19.31 ms of GPU time): the seven scan launches 17.2, torch's cumsum of the log-decay within each
# tile 0.76 (0.38 ms a call, forward and backward), the phase kernel 0.71 (2 calls), time_grads 0.25, partial sums
# 0.20. The cumsum is now in the phase kernel (`_phase_and_decay`, one walk per (b, h) writes both).
#  MK   gpu/mimo_kernels.py (per launch, fwd+bwd)
#  MB   bench/mimo_scan.py: mamba-ssm's static kernels and nam's in one run
#  MP   the plugin's GPU tests
set -u
TOP=$OUT OUT=$OUT/r47 && mkdir -p "$OUT"  # only $TOP/r47.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(mamba-ssm|mimo-scan)|^(fwd|launch|first|digest)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 100 MK python gpu/mimo_kernels.py; show MK 12
step 200 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 190 --json "$OUT/mimo_scan_vs_static.json" --profile "$OUT/prof"; show MB 6
step 240 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 14
tar -C "$TOP" -czf "$TOP/r47.tgz" r47 && rm -rf "$OUT"
