#!/usr/bin/env bash
# Issue 30 (rest) on one H200, round 2: run from the repository root, `bash gpu/n30.sh` (OUT defaults to
# ./gpu-out). The whole run stays under 200 s (each step gets the smaller of its limit and what is left).
# Round 1 (bench/README.md) measured the mixer alone (bench/mamba_recompute.py: mamba-scan bit-exact, +2.67 ms
# and 1.139 GiB kept per layer at b4); its MBS 4 row failed at plugin activation (a cuDNN mix-up on the host)
# and its EP 8 run spent its 100 s building MBS 8's MIMO kernels (the plugin's preflight builds the run's MBS).
# 1. full NAM56R, local engine, MBS 4, fp32-master, train.recompute=mamba-scan: tokens/s, peak GiB, profile
# 2. with what is left: one GPU at one rank's shapes of 8x H200 at EP 8, MBS 8, recompute mamba,moe, built at
#    MBS 4 (--scan-rows 4: the kernels the host has) -- measured peak vs the plan
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site}
export PYTHONUNBUFFERED=1
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # left, limit, log, step
BUDGET=196 STEP_MIN=20 STEP_EXT=.log
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

step 105 mbs4 python bench/megatron.py throughput --gpus 1 --engines local --mbs 4 --numerics fp32-master \
  --recompute mamba-scan --warmup 1 --iters 3 --profile "$OUT/profiles" --json "$OUT/throughput_mbs4.json"
grep -E "^\||Error|error|Killed" "$OUT/mbs4.log" | tail -n 8
head -n 30 "$OUT"/profiles/*.txt 2>/dev/null | cut -c1-60,100-175

step 110 ep8 python bench/megatron.py memory --world 8 --ep 8 --mbs 8 --recompute mamba,moe --steps 2 \
  --scan-rows 4 --json "$OUT/memory_ep8_mbs8.json"
grep -E "^\||^step|Error|error" "$OUT/ep8.log" | tail -n 14
for f in mbs4 ep8; do grep -q Traceback "$OUT/$f.log" 2>/dev/null && { echo "== $f traceback:"; grep -A25 Traceback "$OUT/$f.log" | tail -n 25; }; done
echo "total ${SECONDS}s"
