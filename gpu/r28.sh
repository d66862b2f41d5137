#!/usr/bin/env bash
# Round 28 (2026-11-29), one H200, after `source gpu/host.sh`.
#  CL  issue 29's fastest fp32-master megatron row through the CLI users run (not the bench's worker): 10 steps of
#      `nam train`, megatron + TE bf16, te.moe_fusion, bf16 gradient buffers, recompute mamba-scan,moe, MBS 4, the
#      recipe's hopper-ce head and fused group sums; metrics.jsonl and summary.json come back
#  K1-K3  nam's MIMO scan at b2 x 4096 (gpu/mimo_kernels.py): per-launch ms and the autotuner's timings with a wider
#      backward config list (4, 8, 16 warps; 2 stages for the loops over heads), at PH 4 and 2, and 8-token tiles
# Everything lands in $OUT/r28.tgz.
set -u
TOP=$OUT OUT=$OUT/r28 && mkdir -p "$OUT"  # only $TOP/r28.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-395} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
CL=(--recipe nam56r --engine megatron --nproc 1 --plugins te --set te.fp8=off --set te.moe_fusion=true
    --set train.recompute=mamba-scan,moe --set train.micro_batch_size=4 --set train.grad_reduce_in_fp32=false
    --set train.checkpoint_every=0)
step 130 CL nam train "${CL[@]}" --max-steps 10 --run-dir /tmp/cl --json
startup /tmp/cl
mkdir -p "$OUT/cl" && cp /tmp/cl/*.json /tmp/cl/*.jsonl /tmp/cl/*.log "$OUT/cl/" 2>/dev/null
python -c 'import json,sys,statistics as s; m=[json.loads(l) for l in open(sys.argv[1])]; t=[x["tokens_per_s"] for x in m[1:]]; print("CLI steps 2-%d tokens/s:" % len(m), [round(x) for x in t], "median", round(s.median(t)), "loss", [round(x.get("loss", 0), 3) for x in m])' \
  /tmp/cl/metrics.jsonl | tee -a "$OUT/$SUMMARY"
WIDE=(--bwd-configs 4,1 8,1 16,1 8,2 16,2)
step 120 K1 python gpu/mimo_kernels.py "${WIDE[@]}"; grep -E "^(block_t|first|fwd|launch|bwd:|  )" "$OUT/K1.log" | head -n 40 | tee -a "$OUT/$SUMMARY"
step 90 K2 python gpu/mimo_kernels.py --ph 2 "${WIDE[@]}"; grep -E "^(block_t|fwd|launch)" "$OUT/K2.log" | tee -a "$OUT/$SUMMARY"
step 90 K3 python gpu/mimo_kernels.py --block-t 8 "${WIDE[@]}"; grep -E "^(block_t|fwd|launch)" "$OUT/K3.log" | tee -a "$OUT/$SUMMARY"
tar -C "$TOP" -czf "$TOP/r28.tgz" r28 && rm -rf "$OUT"
