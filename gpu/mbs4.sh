#!/usr/bin/env bash
# Round 2 of gpu/fused.sh (issues 29/30), one H200, after `source gpu/host.sh` (OUT set; the MBS 4 kernels of
# round 1 in .kcache/kcache.tgz). Round 1's megatron MBS 4 rows (TE bf16 and FP8, fused masters, bf16 gradient
# buffers, recompute mamba-scan) stopped at step 0: a non-finite gradient norm, Mamba's dt_bias non-finite
# after the update. This round separates the three changes, each row full NAM56R, MBS 4, TE bf16:
#  A. fused masters + bf16 gradient buffers, recompute mamba (the whole mixer: no for_backward_only replay)
#  B. if A fails: fused masters, fp32 gradient buffers, recompute mamba
#  C. if A fails: Megatron's own masters, bf16 gradient buffers, recompute mamba
#  D. if A runs: A with TE FP8 (current scaling); then the local engine's MBS 4 row (fp32-master, mamba-scan)
# then gpu/smla.sh (issue 32's sparse-MLA kernels, the tile orientations) with what is left.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-520} STEP_MIN=40 STEP_EXT=.log SUMMARY=summary.txt
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3)
bad() { grep -q "Traceback\|OutOfMemory\|out of memory" "$OUT/$1.log"; }
show() { grep -E "^\|.*(local|megatron)|TrainingGuardError|OutOfMemory" "$OUT/$1.log" | tail -n 3; }
FB=(--train-set train.fused_master_weights=true --train-set train.grad_reduce_in_fp32=false)
step 140 A "${M[@]}" --engines megatron --te off --recompute mamba "${FB[@]}" --profile "$OUT/profiles" \
  --json "$OUT/megatron_mbs4_te_fused_bf16grads_mamba.json"; show A
if bad A; then
  step 120 B "${M[@]}" --engines megatron --te off --recompute mamba --train-set train.fused_master_weights=true \
    --json "$OUT/megatron_mbs4_te_fused_mamba.json"; show B
  step 120 C "${M[@]}" --engines megatron --te off --recompute mamba --train-set train.grad_reduce_in_fp32=false \
    --json "$OUT/megatron_mbs4_te_bf16grads_mamba.json"; show C
else
  step 120 D "${M[@]}" --engines megatron --te current --recompute mamba "${FB[@]}" \
    --json "$OUT/megatron_mbs4_te_fp8_fused_bf16grads_mamba.json"; show D
  step 90 L "${M[@]}" --engines local --te none --recompute mamba-scan --json "$OUT/local_mbs4_scan.json"; show L
fi
if (( $(left) > 100 )); then
  mkdir -p "$OUT/smla"; OUT="$OUT/smla" BUDGET=$(( $(left) - 5 )) bash gpu/smla.sh > "$OUT/smla.log" 2>&1
  tail -n 25 "$OUT/smla.log"
fi
for d in smla profiles; do [[ -d $OUT/$d ]] && tar -C "$OUT" -czf "$OUT/$d.tgz" "$d" && rm -rf "${OUT:?}/$d"; done
log done
