#!/usr/bin/env bash
# Issue 31 item 3 on one GPU (branch convert): a run continued by the other engine, bf16, through `nam export
# --with-optimizer` and `nam train --init-from`. Run from the repository root: `bash gpu/convert.sh` (OUT defaults
# to ./gpu-out). nam56r-tiny (reference backends: no kernel builds), bf16 with fp32-master, seq 64, 4 steps,
# checkpoint at step 2; the whole script stays under 175 s (each step gets the smaller of its limit and what is
# left).
# 1. local, 4 steps (the reference); its step-2 export with the optimizer continued by the megatron engine (1 GPU)
# 2. megatron, 4 steps (the reference); its step-2 export with the optimizer continued by the local engine
# The table: each continuation's steps 3-4 against its original's (loss, grad norm, relative), and the two
# references' step 1 (the same weights and rows, before any update: the engines' bf16 floor).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site}
export PYTHONUNBUFFERED=1
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # left, limit, log, step
BUDGET=175 STEP_MIN=15 STEP_EXT=.log
R=$(mktemp -d)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
COMMON=(--recipe nam56r-tiny --device cuda --seed 1234 --data "$R/data" --set train.dtype=bfloat16
        --set train.optimizer_numerics=fp32-master --set attention_backend=reference
        --set train.checkpoint_every=2 --set train.micro_batch_size=2 --set train.grad_accum=2 -q)
MEG=(--engine megatron --nproc 1)

step 30 data python -m nam_cli data prepare nam56r --out "$R/data"
step 45 local python -m nam_cli train "${COMMON[@]}" --run-dir "$R/local" --max-steps 4
step 20 local-export python -m nam_cli export "$R/local/checkpoints/step-00000002" --out "$R/local-export" --tokenizer byte \
  --with-optimizer --json
step 60 megatron-from-local python -m nam_cli train "${COMMON[@]}" "${MEG[@]}" --run-dir "$R/megatron-from-local" \
  --init-from "$R/local-export" --max-steps 4
step 60 megatron python -m nam_cli train "${COMMON[@]}" "${MEG[@]}" --run-dir "$R/megatron" --max-steps 4
step 20 megatron-export python -m nam_cli export "$R/megatron/checkpoints/step-00000002" --out "$R/megatron-export" \
  --tokenizer byte --with-optimizer --json
step 45 local-from-megatron python -m nam_cli train "${COMMON[@]}" --run-dir "$R/local-from-megatron" \
  --init-from "$R/megatron-export" --max-steps 4

for d in local megatron-from-local megatron local-from-megatron; do
  cp "$R/$d/metrics.jsonl" "$OUT/$d.metrics.jsonl" 2>/dev/null
  grep -h "weights and optimizer state" "$R/$d/run.log" 2>/dev/null | head -n 1
done
python - "$R" <<'EOF' | tee "$OUT/table.txt"
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
def rows(name):
    p = root / name / "metrics.jsonl"
    return {m["step"]: m for m in map(json.loads, p.read_text().splitlines()) if "loss" in m} if p.is_file() else {}
rel = lambda a, b: abs(a - b) / abs(b)
print("| continuation | original | step | loss | original loss | rel | grad norm | original | rel |")
print("|---|---|---|---|---|---|---|---|---|")
for cont, orig in (("megatron-from-local", "local"), ("local-from-megatron", "megatron")):
    c, o = rows(cont), rows(orig)
    for s in (3, 4):
        if s in c and s in o:
            print(f"| {cont} | {orig} | {s} | {c[s]['loss']:.6f} | {o[s]['loss']:.6f} | {rel(c[s]['loss'], o[s]['loss']):.2e} "
                  f"| {c[s]['grad_norm']:.4f} | {o[s]['grad_norm']:.4f} | {rel(c[s]['grad_norm'], o[s]['grad_norm']):.2e} |")
        else:
            print(f"| {cont} | {orig} | {s} | missing | | | | | |")
l, m = rows("local"), rows("megatron")
if 1 in l and 1 in m:
    print(f"floor, step 1 local vs megatron: loss rel {rel(m[1]['loss'], l[1]['loss']):.2e}, "
          f"grad norm rel {rel(m[1]['grad_norm'], l[1]['grad_norm']):.2e}")
EOF
for f in data local local-export megatron-from-local megatron megatron-export local-from-megatron; do
  grep -q -E "Traceback|error:" "$OUT/$f.log" 2>/dev/null && { echo "== $f:"; grep -E -A12 "Traceback|error:" "$OUT/$f.log" | tail -n 14; }
done
rm -rf "$R"
echo "total ${SECONDS}s"
