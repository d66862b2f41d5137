#!/usr/bin/env bash
# Round 3 (issues 29/30/32), one H200, after `source gpu/host.sh` (OUT set; the MBS 4 kernels in .kcache):
#  P. full NAM56R, megatron engine, MBS 4, TE bf16, Megatron's fp32 masters, bf16 gradient buffers, recompute
#     mamba (round 2's row C), with a profile: where the megatron engine's time goes
#  F. the same with TE FP8 (current scaling): issue 29's FP8 ratio at MBS 4
#  L. the local engine, MBS 4, fp32-master, mamba-scan (same session's baseline; nam_core now loads torch's
#     cuDNN on a TE host, which round 1's local row lacked)
#  then sparse-mla with the new default tiles: its GPU tests, bench/sparse_mla.py, bench/indexer.py
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-400} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3)
show() { grep -E "^\|.*(local|megatron)|TrainingGuardError|OutOfMemory|Error" "$OUT/$1.log" | tail -n 3; }
step 120 P "${M[@]}" --engines megatron --te off --recompute mamba --train-set train.grad_reduce_in_fp32=false \
  --profile "$OUT/profiles" --json "$OUT/megatron_mbs4_te_bf16grads_mamba_profiled.json"; show P
step 100 F "${M[@]}" --engines megatron --te current --recompute mamba --train-set train.grad_reduce_in_fp32=false \
  --json "$OUT/megatron_mbs4_te_fp8_bf16grads_mamba.json"; show F
step 90 L "${M[@]}" --engines local --te none --recompute mamba-scan --json "$OUT/local_mbs4_scan.json"; show L
step 60 smla_tests python -m pytest -m gpu plugins/nam-plugin-sparse-mla/tests -q -p no:cacheprovider
tail -n 2 "$OUT/smla_tests.log"
step 25 smla_bench python bench/sparse_mla.py --warmup 2 --iters 10 --json "$OUT/sparse_mla.json"
tail -n 5 "$OUT/smla_bench.log"
step 25 indexer_bench python bench/indexer.py --batch 2 --warmup 2 --iters 10 --json "$OUT/indexer.json"
tail -n 6 "$OUT/indexer_bench.log"
for d in smla profiles; do [[ -d $OUT/$d ]] && tar -C "$OUT" -czf "$OUT/$d.tgz" "$d" && rm -rf "${OUT:?}/$d"; done
log done
