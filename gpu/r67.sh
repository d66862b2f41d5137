#!/usr/bin/env bash
# Round 67, 2026-12-07 (tenth session), the same H100 as r66 (warm), after `source gpu/host.sh`, with r66's kernel
# cache. Probes, on a working tree with kernels.py's NAM_MIMO_PROBE_NOROT switch (wrong on purpose, so not
# committed: `git apply gpu/r67-norot.patch` first, `git checkout` the file after):
#  MKW   gpu/mimo_kernels.py with the walks offered 4 and 8 warps, 1 and 2 stages, PSPLIT 1 and 2 (the tuner's
#        timings of each; the shipped lists have no 8-warp state walk since r30)
#  MKN   gpu/mimo_kernels.py with NAM_MIMO_PROBE_NOROT=1: the state walk, the dstate walk, fwd_chunk and the
#        per-head pass read no phase table and rotate nothing (q, k + bias as loaded): how much rows rotated
#        once ahead of them could save at most
#  MKP   the same build without the switch (the probe's code layout, rotation on): its digest must be r66's
# Result (H100, ran BUDGET=290, the probe patch applied): MKW: the state walk 1.10 ms at 4 warps 1 stage (the
# shipped choice) against 1.41 at 8 warps, 2.04 at 8 warps 2 stages, 1.57 / 1.96 at PSPLIT 2 (4 / 8 warps); the
# dstate walk 1.44 against 1.46 / 2.20 / 1.70 / 2.14: nothing to add. MKN (no table, no rotation; digest
# 7664b2d94c8ff4bc, wrong on purpose) against MKP (the same build, rotation on; digest 85d88b6746c5ee36): state walk
# 0.89 / 1.10, dstate walk 1.05 / 1.43, fwd_chunk 1.86 / 1.96, per-head pass 4.85 / 5.18 ms; fwd+bwd 16.49 / 17.54.
# So the table and the rotation cost those four kernels ~1.05 ms a step at most, about what writing rotated q~ and
# k~ once a pass would cost (2 GiB bf16 at b2: ~0.6 ms of H100 bandwidth, forward and backward): not built.
set -u
TOP=$OUT OUT=$OUT/r67 && mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^ok |ERROR SUMMARY|Out-of|Invalid|at bwd_kernel|digest|^fwd |^launch |^tuned (state|dstate)|rror|Traceback" \
  "$OUT/$1.log" | head -n "${2:-30}" | tee -a "$OUT/$SUMMARY"; }
step 110 MKW python gpu/mimo_kernels.py --walk-configs 4,1,1 8,1,1 8,2,1 4,1,2 8,1,2; show MKW 40
step 110 MKN env NAM_MIMO_PROBE_NOROT=1 python gpu/mimo_kernels.py; show MKN
step 60 MKP python gpu/mimo_kernels.py; show MKP
tar -C "$TOP" -czf "$TOP/r67.tgz" r67 && rm -rf "$OUT"
