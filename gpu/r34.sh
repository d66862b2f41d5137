#!/usr/bin/env bash
# Round 34 (prepared 2026-11-29, NOT YET RUN), one H200, after `source gpu/host.sh`:
#  MB  bench/mimo_scan.py: mamba-ssm's static kernels against mimo-scan in one run (r31's try stopped at 110 s in
#      the TileLang build: this one allows 300 s a row)
#  MF  the per-head pass at 4 warps with 1 stage at 32-token tiles (r32's check ran out of time compiling): if it
#      passes, kernels.PER_HEAD_CONFIGS may take it back
set -u
TOP=$OUT OUT=$OUT/r34 && mkdir -p "$OUT"  # only $TOP/r34.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=25 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd)|^\|.*(mamba-ssm|mimo-scan)|passed|failed|FAILED|rror" "$OUT/$1.log" \
  | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 330 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 300 --json "$OUT/mimo_scan_vs_static.json"; show MB 6
step 120 MF4_1 env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py 4 1 --pass CHUNK; show MF4_1 3
kcache_pack
tar -C "$TOP" -czf "$TOP/r34.tgz" r34 && rm -rf "$OUT"
