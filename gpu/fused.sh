#!/usr/bin/env bash
# Issues 29/30/31 on one H200, one run (`source gpu/host.sh` first; OUT set). Under 530 s (BUDGET) after the host setup.
#  1. cold `nam preflight --recipe nam56r` at MBS 4 (issue 31: <= 180 s on a fresh host; empty kernel caches),
#     and meanwhile, in the background: nam56r-tiny on the megatron engine with TE bf16 linears, 6 steps, with
#     Megatron's own fp32 masters and with train.fused_master_weights (TE's FusedAdam): per-step loss and
#     gradient norm side by side (same numerics: they should agree to bf16 rounding)
#  2. full NAM56R, megatron engine, TE bf16, MBS 4, fp32 masters in TE's FusedAdam, bf16 gradient buffers,
#     recompute mamba-scan, with a profile (issues 29 and 30); the same row with TE FP8 (current scaling:
#     issue 29's FP8 ratio); the local engine's row at the same settings
#  3. if the megatron MBS 4 row ran out of memory: recompute mamba (the whole mixer) instead
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-530} STEP_MIN=40 STEP_EXT=.log SUMMARY=summary.txt
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git log --oneline -1 | tee -a "$OUT/gpu.txt"

TINY=(--recipe nam56r-tiny --device cuda --set train.dtype=bfloat16 --set mamba_rope_fraction=1.0 --max-steps 6
      --set attention_backend=reference --plugins te --engine megatron --nproc 1 --set train.checkpoint_every=0 -q)
( for f in false true; do
    NAM_CACHE_DIR=/tmp/tiny-cache timeout 150 nam train "${TINY[@]}" --set train.fused_master_weights=$f --run-dir "$OUT/tiny-fused-$f" \
      > "$OUT/tiny-fused-$f.log" 2>&1; echo "rc=$?" >> "$OUT/tiny-fused-$f.log"
  done
  python - "$OUT" > "$OUT/tiny-fused-compare.txt" 2>&1 <<'PY'
import json, sys
out = sys.argv[1]
rows = {f: [json.loads(l) for l in open(f"{out}/tiny-fused-{f}/metrics.jsonl")] for f in ("false", "true")}
print("step  loss (megatron masters)  loss (fused)  rel diff   grad norm (megatron)  grad norm (fused)  rel diff")
worst = 0.0
for a, b in zip(rows["false"], rows["true"]):
    dl = abs(a["loss"] - b["loss"]) / abs(a["loss"]); dg = abs(a["grad_norm"] - b["grad_norm"]) / abs(a["grad_norm"])
    worst = max(worst, dl)
    print(f"{a['step']:>4}  {a['loss']:>22.6f}  {b['loss']:>12.6f}  {dl:.2e}   {a['grad_norm']:>20.6f}  {b['grad_norm']:>17.6f}  {dg:.2e}")
print(f"worst loss rel diff {worst:.2e}")
PY
) &
tiny=$!

step 250 preflight_cold bash -c 'rm -rf "$NAM_CACHE_DIR"; mkdir -p "$NAM_CACHE_DIR"; s=$(date +%s.%N);
  nam preflight --recipe nam56r --set train.micro_batch_size=4; r=$?; e=$(date +%s.%N);
  echo "preflight wall $(python -c "print(round($e - $s, 1))") s, rc=$r"'
tail -n 3 "$OUT/preflight_cold.log"
wait $tiny; cat "$OUT/tiny-fused-compare.txt"; grep -h "rc=\|Error" "$OUT"/tiny-fused-*.log | head

M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3
   --train-set train.fused_master_weights=true --train-set train.grad_reduce_in_fp32=false)
step 150 meg_mbs4_scan "${M[@]}" --engines megatron --te off --recompute mamba-scan --profile "$OUT/profiles" \
  --json "$OUT/megatron_mbs4_te_fused_scan.json"
grep -E "^\||Error|OutOfMemory" "$OUT/meg_mbs4_scan.log" | tail -n 6
if grep -q "OutOfMemory\|out of memory" "$OUT/meg_mbs4_scan.log"; then
  step 130 meg_mbs4_mamba "${M[@]}" --engines megatron --te off --recompute mamba \
    --json "$OUT/megatron_mbs4_te_fused_mamba.json"
  grep -E "^\||Error|OutOfMemory" "$OUT/meg_mbs4_mamba.log" | tail -n 6
  RC=mamba
else
  RC=mamba-scan
fi
step 130 meg_mbs4_fp8 "${M[@]}" --engines megatron --te current --recompute $RC \
  --json "$OUT/megatron_mbs4_te_fp8_fused.json"
grep -E "^\||Error|OutOfMemory" "$OUT/meg_mbs4_fp8.log" | tail -n 4
step 100 local_mbs4 "${M[@]}" --engines local --te none --recompute mamba-scan --json "$OUT/local_mbs4_scan.json"
grep -E "^\||Error|OutOfMemory" "$OUT/local_mbs4.log" | tail -n 4
for f in "$OUT"/*.log; do grep -q Traceback "$f" && { echo "== $f:"; grep -B2 -A3 "Error" "$f" | tail -n 12; }; done
log "done"
