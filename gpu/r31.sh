#!/usr/bin/env bash
# Round 31 (2026-11-29), one H200, after `source gpu/host.sh`. nam's MIMO scan with the per-head pass handing
# dL/d(q~.k~) and dy to the dq and dk passes (they no longer form dy, v, the decay and dL/dM), the per-head pass
# pruned to one stage again:
#  MF  which config faulted in r30 at 32-token tiles: the per-head pass at 4 and 8 warps with 2 stages, one
#      process each, CUDA_LAUNCH_BLOCKING=1 (gpu/mimo_fault.py)
#  MP  the plugin's GPU tests in full (the 32-token case first)
#  MK  gpu/mimo_kernels.py: fwd, fwd+bwd, per-launch ms, every pass's tuner timings
#  MB  bench/mimo_scan.py: mamba-ssm's static kernels against mimo-scan, one run
set -u
TOP=$OUT OUT=$OUT/r31 && mkdir -p "$OUT"  # only $TOP/r31.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-550} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first)|^\|.*(mamba-ssm|mimo-scan)|passed|failed|FAILED|rror" "$OUT/$1.log" \
  | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
for cfg in "4 2" "8 2"; do
  step 60 "MF${cfg// /_}" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py $cfg --pass CHUNK
  show "MF${cfg// /_}" 3
done
step 60 MP32 python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -q -p no:cacheprovider \
  -k "8-32"; show MP32 4
step 170 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -q -p no:cacheprovider \
  -k "not 8-32"; show MP 10
step 120 MK python gpu/mimo_kernels.py; show MK 60
step 130 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 110 --json "$OUT/mimo_scan_vs_static.json"; show MB 6
tar -C "$TOP" -czf "$TOP/r31.tgz" r31 && rm -rf "$OUT"
