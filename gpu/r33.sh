#!/usr/bin/env bash
# Round 33 (prepared 2026-11-29, NOT YET RUN: the session's device time was spent), one H200, after
# `source gpu/host.sh`. nam's MIMO scan as committed after r32, which no GPU has run: the per-head pass only at 4
# warps with 2 stages or 16 warps; the walks offered their 2-stage configs again (r32's prune had dropped them by
# mistake); dq / dk able to run in windows of n's columns (config NS; offline, sm_90: no spills and 125-230
# registers at NS 2-4 against 255 with 36-1,024 B of spills at NS 1; not in the default list):
#  MK   gpu/mimo_kernels.py: fwd, fwd+bwd, per-launch ms, every pass's tuner timings (the walks at 1 and 2 stages)
#  MKNS the same with dq / dk offered NS 2 and 4 (--bwd-configs)
#  MFNS dq and dk at NS 2 and 4 against the reference at 16- and 32-token tiles (gpu/mimo_fault.py)
#  MP   the plugin's GPU tests in full
# Round 34 (gpu/r34.sh): static against nam in one run, the per-head pass at 4 warps 1 stage at 32-token tiles.
set -u
TOP=$OUT OUT=$OUT/r33 && mkdir -p "$OUT"  # only $TOP/r33.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=25 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|block_t)|passed|failed|FAILED|rror" "$OUT/$1.log" \
  | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 70 MK python gpu/mimo_kernels.py; show MK 40
step 90 MKNS python gpu/mimo_kernels.py --bwd-configs 4,1,1 8,1,1 16,1,1 8,2,1 4,2,1 4,1,2 8,1,2 4,2,2 8,2,2 \
  4,1,4 8,1,4 4,2,4 8,2,4; show MKNS 40
for pass in DQ DK; do
  for ns in 2 4; do
    for bt in 16 32; do
      step 40 "MF_${pass}_${ns}_${bt}" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py 4 2 --pass $pass --ns $ns \
        --block-t $bt; show "MF_${pass}_${ns}_${bt}" 2
    done
  done
done
step 250 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 12
kcache_pack
tar -C "$TOP" -czf "$TOP/r33.tgz" r33 && rm -rf "$OUT"
