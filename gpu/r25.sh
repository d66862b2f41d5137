#!/usr/bin/env bash
# Round 25 (prepared 2026-11-28, seventh session; NOT YET RUN: the session's device time was spent), one H200,
# after `source gpu/host.sh`. Issue 29's 10,000 tokens/s at the record's numerics (fp32-master: fp32 master weights
# and moments), which r22 met only with bf16 moments (10,391). At fp32-master the megatron engine fits at MBS 4:
#   mamba             (8,999 with Liger's head, r2; the hopper-ce head saved 99 ms a step in r22)
#   mamba-scan,moe    plan 131.4 GiB with bf16 gradient buffers (as the local engine keeps them), 140.2 with fp32
#   mamba-scan        plan 145.5 GiB: does not fit
# (`nam train --recipe nam56r --engine megatron --nproc 1 --plugins te --dry-run --device-profile h200 --set
# te.fp8=off --set train.micro_batch_size=4 --set train.grad_reduce_in_fp32=false --set te.moe_fusion=true --set
# train.recompute=...`). Every row: TE bf16, te.moe_fusion, the recipe's hopper-ce head (gradients in forward).
#  FM   recompute mamba
#  FS   recompute mamba-scan,moe (profiled)
#  FF   the faster of the two in TE FP8 current scaling (run both: the script cannot know which before)
# Everything lands in $OUT/r25.tgz.
set -u
TOP=$OUT OUT=$OUT/r25 && mkdir -p "$OUT"  # only $TOP/r25.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-550} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*megatron|GPU busy|TrainingGuardError|OutOfMemory|Error" "$OUT/$1.log" | tail -n 4 | tee -a "$OUT/$SUMMARY"; }
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3 --engines megatron --numerics fp32-master
   --train-set train.grad_reduce_in_fp32=false --train-set te.moe_fusion=true)
step 130 FM "${M[@]}" --te off --recompute mamba --json "$OUT/megatron_fp32master_mamba.json"; show FM
step 170 FS "${M[@]}" --te off --recompute mamba-scan,moe --profile "$OUT/prof" --json "$OUT/megatron_fp32master_mamba_scan_moe.json"; show FS
step 220 FF "${M[@]}" --te current --recompute "mamba/mamba-scan,moe" --json "$OUT/megatron_fp32master_fp8.json"; show FF
tar -C "$TOP" -czf "$TOP/r25.tgz" r25 && rm -rf "$OUT"
