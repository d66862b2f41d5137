#!/usr/bin/env bash
# Round 20 (prepared 2026-11-28, sixth session, NOT YET RUN: the session's device time was spent), one H200, after
# `source gpu/host.sh`. Issue 29's 10,000 tokens/s, bf16 linears, fp32 master weights: the megatron engine's gap to
# the local engine was its recompute (it fit `mamba` at MBS 4, the local engine `mamba-scan`: 8,999 against
# 9,764-9,855). With Adam's moments in bf16 (train.optimizer_numerics=bf16-moments: fp32 masters and fp32
# gradient buffers kept) the plan puts megatron + mamba-scan at MBS 4 at 127.9 GiB (`nam train ... --dry-run
# --device-profile h200`, below), under the H200's memory; at fp32 moments it is 145.5 GiB (does not fit).
#  MS  megatron, TE bf16, te.moe_fusion, bf16-moments, recompute mamba-scan, MBS 4 (the candidate)
#  MM  the same with recompute mamba (the same numerics, last session's recompute): the ratio
#  LS  local, fp32-master, mamba-scan, MBS 4: the same machine's local row
# Plan: nam train --recipe nam56r --engine megatron --nproc 1 --plugins te --dry-run --device-profile h200
#   --set te.fp8=off --set train.recompute=mamba-scan --set train.micro_batch_size=4
#   --set train.optimizer_numerics=bf16-moments --set te.moe_fusion=true
# Everything lands in $OUT/r20.tgz.
set -u
TOP=$OUT OUT=$OUT/r20 && mkdir -p "$OUT"  # only $TOP/r20.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-545} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3)
show() { grep -E "^\|.*(local|megatron)|TrainingGuardError|OutOfMemory|Error" "$OUT/$1.log" | tail -n 3 | tee -a "$OUT/$SUMMARY"; }
MEG=(--engines megatron --te off --numerics bf16-moments --train-set te.moe_fusion=true)
step 180 MS "${M[@]}" "${MEG[@]}" --recompute mamba-scan --json "$OUT/megatron_mbs4_bf16moments_mamba_scan.json"; show MS
step 170 MM "${M[@]}" "${MEG[@]}" --recompute mamba --json "$OUT/megatron_mbs4_bf16moments_mamba.json"; show MM
step 150 LS "${M[@]}" --engines local --te none --recompute mamba-scan --json "$OUT/local_mbs4_mamba_scan.json"; show LS
tar -C "$TOP" -czf "$TOP/r20.tgz" r20 && rm -rf "$OUT"
