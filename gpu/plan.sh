#!/usr/bin/env bash
# Issue 30 item 3 (branch plan), round 2 on one H200: run from the repository root, `bash gpu/plan.sh` (OUT defaults
# to ./gpu-out). Under 180 s. Round 1 measured the activation constants (bench/activations.py ->
# nam56r/activations.json). This round measures the peak the plan most needs checked and no run recorded: full
# NAM56R, local engine, MBS 4, fp32-master, train.recompute=mamba-scan (an earlier round ran 6 steps of it in
# 105 s but was cut before writing its peak). 2 steps (1 warm-up, 1 timed): the peak is the allocator's over both.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -k 5 170 python bench/megatron.py throughput --gpus 1 --engines local --mbs 4 --numerics fp32-master \
  --recompute mamba-scan --warmup 1 --iters 1 --json "$OUT/numerics_recompute_local_mbs4_mamba_scan_h200.json" \
  > "$OUT/mbs4.log" 2>&1
echo "== mbs4 mamba-scan: rc $? at ${SECONDS}s"
grep -E "^\||Error|error|Killed|peak" "$OUT/mbs4.log" | tail -n 12
