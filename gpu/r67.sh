#!/usr/bin/env bash
# Round 67, 2026-12-07 (tenth session), one H200, after `source gpu/host.sh`, with r66's kernel cache. Probes on
# a working tree with kernels.py's NAM_MIMO_PROBE_NOROT switch (a probe, wrong on purpose; not committed: the
# patch is gpu/r67-norot.patch):
#  MKW   gpu/mimo_kernels.py with the walks offered 4 and 8 warps, 1 and 2 stages, PSPLIT 1 and 2 (the tuner's
#        timings of each; the shipped lists have no 8-warp state walk since r30)
#  MKN   gpu/mimo_kernels.py with NAM_MIMO_PROBE_NOROT=1: the state walk, the dstate walk, fwd_chunk and the
#        per-head pass read no phase table and rotate nothing (q, k + bias as loaded): how much rows rotated
#        once ahead of them could save at most
#  MKP   the same build without the switch (the probe's code layout, rotation on): its digest must be r66's
#  SS32  memcheck over mimo_fault.py: the shipped set at 32-token tiles (dq / dk at NS 2, 2 stages)
#  PH16  memcheck over mimo_fault.py: the per-head pass at 16 warps, 1 stage (a config the tuner times), 16-token
#        tiles
# Result: (filled in after the round)
set -u
TOP=$OUT OUT=$OUT/r67 && mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^ok |ERROR SUMMARY|Out-of|Invalid|at bwd_kernel|digest|^fwd |^launch |^tuned (state|dstate)|rror|Traceback" \
  "$OUT/$1.log" | head -n "${2:-30}" | tee -a "$OUT/$SUMMARY"; }
step 150 MKW python gpu/mimo_kernels.py --walk-configs 4,1,1 8,1,1 8,2,1 4,1,2 8,1,2; show MKW 40
step 120 MKN env NAM_MIMO_PROBE_NOROT=1 python gpu/mimo_kernels.py; show MKN
step 90 MKP python gpu/mimo_kernels.py; show MKP
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
mc=("$san" --tool memcheck --kernel-name kns=bwd_kernel --print-limit 4 python gpu/mimo_fault.py)
step 70 SS32 "${mc[@]}" 4 2 --pass DQ --ns 2 --block-t 32; show SS32 8
step 70 PH16 "${mc[@]}" 16 1 --pass CHUNK --block-t 16; show PH16 8
tar -C "$TOP" -czf "$TOP/r67.tgz" r67 && rm -rf "$OUT"
