#!/usr/bin/env bash
# Round 21 (2026-11-28, seventh session), one H200, after `source gpu/host.sh`: gpu/r20.sh's candidate for issue
# 29's 10,000 tokens/s (bf16 linears, fp32 master weights and fp32 gradient buffers, Adam's moments in bf16:
# train.optimizer_numerics=bf16-moments), with the FP8 row of the same engine and recompute in place of r20's
# `mamba` row (the 1.2x target is against the bf16 row of the same engine), and the local row.
#  MS  megatron, TE bf16, te.moe_fusion, bf16-moments, recompute mamba-scan, MBS 4 (plan 127.9 GiB), profiled
#      (two extra steps, outside the medians)
#  MF  the same with TE FP8 current scaling on TE's linears
#  LS  local, fp32-master, mamba-scan, MBS 4: the same machine's local row
# Everything lands in $OUT/r21.tgz.
set -u
TOP=$OUT OUT=$OUT/r21 && mkdir -p "$OUT"  # only $TOP/r21.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-550} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3)
show() { grep -E "^\|.*(local|megatron)|GPU busy|TrainingGuardError|OutOfMemory|Error" "$OUT/$1.log" | tail -n 4 | tee -a "$OUT/$SUMMARY"; }
MEG=(--engines megatron --numerics bf16-moments --recompute mamba-scan --train-set te.moe_fusion=true)
step 200 MS "${M[@]}" "${MEG[@]}" --te off --profile "$OUT/prof" --json "$OUT/megatron_mbs4_bf16moments_mamba_scan.json"; show MS
step 170 MF "${M[@]}" "${MEG[@]}" --te current --json "$OUT/megatron_mbs4_bf16moments_mamba_scan_fp8.json"; show MF
step 150 LS "${M[@]}" --engines local --te none --recompute mamba-scan --json "$OUT/local_mbs4_mamba_scan.json"; show LS
tar -C "$TOP" -czf "$TOP/r21.tgz" r21 && rm -rf "$OUT"
