#!/usr/bin/env bash
# Issue 30 (rest) on one H200: run from the repository root, `bash gpu/n30.sh` (OUT defaults to ./gpu-out).
# The whole run stays under 4 minutes (each step gets the smaller of its limit and what is left of BUDGET).
# 1. one Mamba-3 mixer at NAM56R's width, b4 x 4096: none / mamba / mamba-scan, time, kept memory, and the
#    largest difference from no recompute (bit-exact check of the mamba-scan replay on the real kernels)
# 2. full NAM56R, local engine, MBS 4, fp32-master, train.recompute=mamba-scan: tokens/s, peak GiB, profile
# 3. one GPU at one rank's shapes of 8x H200 at EP 8, MBS 8, recompute mamba,moe: measured peak vs the plan
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site}
export PYTHONUNBUFFERED=1
BUDGET=232
left() { echo $((BUDGET - SECONDS)); }
step() {  # step SECONDS_WANTED LOGNAME CMD...: runs CMD under the smaller of what it wants and what is left
  local want=$1 name=$2; shift 2
  local t; t=$(left); [ "$want" -lt "$t" ] && t=$want
  if [ "$t" -lt 20 ]; then echo "== $name: skipped (${t}s left)"; return; fi
  echo "== $name (limit ${t}s, at ${SECONDS}s)"
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc $? at ${SECONDS}s"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1

step 40 mixer python bench/mamba_recompute.py --batch 4 --warmup 1 --iters 3 --json "$OUT/mamba_recompute.json"
grep -E "^\||^floor|Error|error" "$OUT/mixer.log" | tail -n 12

step 100 mbs4 python bench/megatron.py throughput --gpus 1 --engines local --mbs 4 --numerics fp32-master \
  --recompute mamba-scan --warmup 1 --iters 3 --profile "$OUT/profiles" --json "$OUT/throughput_mbs4.json"
grep -E "^\||Error|error|Killed" "$OUT/mbs4.log" | tail -n 8
head -n 30 "$OUT"/profiles/*.txt 2>/dev/null | cut -c1-60,100-175

step 100 ep8 python bench/megatron.py memory --world 8 --ep 8 --mbs 8 --recompute mamba,moe --steps 2 \
  --scan-rows 4 --json "$OUT/memory_ep8_mbs8.json"
grep -E "^\||^step|Error|error" "$OUT/ep8.log" | tail -n 14
for f in mixer mbs4 ep8; do grep -q Traceback "$OUT/$f.log" 2>/dev/null && { echo "== $f traceback:"; grep -A25 Traceback "$OUT/$f.log" | tail -n 25; }; done
echo "total ${SECONDS}s"
