#!/usr/bin/env bash
# Issue 30 item 3 (branch plan) on one H200: run from the repository root, `bash gpu/plan.sh` (OUT defaults to
# ./gpu-out). Under 180 s. The activations ONE block of each NAM56R kind (Mamba-3 MIMO, MoE, DSA, MLA, an MTP
# depth, the CE head, the embedding) keeps for backward under each recompute choice, at full width, micro-batches
# 4 and 2 (the host's warm kernel shapes): bench/activations.py, whose JSON is the constants file
# nam56r/activations.json that nam56r.memory plans with. The JSON is rewritten after each part, so a run cut
# short keeps what it measured.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -k 5 165 python bench/activations.py --batch 4 2 --json "$OUT/activations.json" > "$OUT/activations.log" 2>&1
echo "== activations: rc $? at ${SECONDS}s"
grep -vE "Warning|warn\(" "$OUT/activations.log" | tail -c 10000
