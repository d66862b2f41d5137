#!/usr/bin/env bash
# Round 33 (prepared 2026-11-29, NOT YET RUN: the session's device time was spent), one H200, after
# `source gpu/host.sh`. nam's MIMO scan as committed after r32 (the per-head pass only at 4 warps with 2 stages or
# 16 warps; the walks offered their 2-stage configs again, which r32's prune had dropped by mistake):
#  MB  bench/mimo_scan.py: mamba-ssm's static kernels against mimo-scan in one run (r31's try stopped at 110 s in
#      the TileLang build: this one allows 300 s a row)
#  MK  gpu/mimo_kernels.py: fwd, fwd+bwd, per-launch ms, every pass's tuner timings (the walks at 1 and 2 stages)
#  MF  the per-head pass at 4 warps with 1 stage at 32-token tiles (r32's check ran out of time compiling): if it
#      passes, kernels.PER_HEAD_CONFIGS may take it back
#  MP  the plugin's GPU tests in full
set -u
TOP=$OUT OUT=$OUT/r33 && mkdir -p "$OUT"  # only $TOP/r33.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=25 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first)|^\|.*(mamba-ssm|mimo-scan)|passed|failed|FAILED|rror" "$OUT/$1.log" \
  | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 330 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 300 --json "$OUT/mimo_scan_vs_static.json"; show MB 6
step 60 MK python gpu/mimo_kernels.py; show MK 40
step 90 MF4_1 env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py 4 1 --pass CHUNK; show MF4_1 3
step 250 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 12
tar -C "$TOP" -czf "$TOP/r33.tgz" r33 && rm -rf "$OUT"
