#!/usr/bin/env bash
# Round 35 (2026-11-29, third session), one H200, after `source gpu/host.sh`. r33 found dk 3.90 -> 3.50 ms in
# windows (NS 2, 4 warps, 2 stages; now in kernels.CONFIGS). Every bwd pass and fwd_chunk is register-bound at
# 12.5% occupancy (255 registers a thread: 2 blocks of 4 warps an SM); this round times a cap on the registers
# (Triton's maxnreg; offline, sm_90: the per-head pass at 4 warps 1 stage capped at 168 spills 352 B and fits 3
# blocks an SM by registers and shared memory; dq / dk in 4 windows at 8 warps capped at 128: no spills, 2 blocks
# of 8 warps), then checks the candidates against the reference, then static against nam in one run:
#  MK  gpu/mimo_kernels.py over the sweep (the per-head pass offered any config: timing only)
#  MF  the per-head candidates and dq in 2 windows against the reference (gpu/mimo_fault.py), 16- and 32-token tiles
#  MB  bench/mimo_scan.py: mamba-ssm's static kernels against mimo-scan, one run, 300 s a row (r34's step)
set -u
TOP=$OUT OUT=$OUT/r35 && mkdir -p "$OUT"  # only $TOP/r35.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=25 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|block_t)|^\|.*(mamba-ssm|mimo-scan)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 150 MK python gpu/mimo_kernels.py --unchecked-per-head \
  --bwd-configs 4,2,1 4,1,1 4,1,1,168 4,1,1,128 8,1,1,128 8,2,1 4,2,2 4,2,2,168 4,1,2,128 8,1,2,128 \
  4,1,4,128 8,1,4,128 --chunk-configs 4,1 8,1 8,1,128 4,1,168; show MK 60
for c in "CHUNK 4 1 168 16" "CHUNK 8 1 128 16" "CHUNK 4 1 0 16" "CHUNK 4 1 168 32" "DQ 4 2 0 32"; do
  set -- $c
  ns=1; [[ $1 == DQ ]] && ns=2
  step 60 "MF_$1_$2_$3_$4_$5" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py $2 $3 --pass $1 --ns $ns \
    --block-t $5 $( (( $4 > 0 )) && echo --maxnreg $4 ); show "MF_$1_$2_$3_$4_$5" 2
done
step 330 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 300 --json "$OUT/mimo_scan_vs_static.json"; show MB 6
kcache_pack
tar -C "$TOP" -czf "$TOP/r35.tgz" r35 && rm -rf "$OUT"
