#!/usr/bin/env bash
# Round 7 (2026-11-28, third session), one H200, after `source gpu/host.sh` with round 5's caches (inductor's now
# among them):
#  AC  the megatron engine's allocator setting (checks.PINNED_CONF) parses in this torch and a page-locked block
#      comes from it (a wrong key would stop every megatron run at its first CUDA allocation)
#  W3  warm start after the fixes (inputs drawn on the GPU, Triton's autotune choices on disk): run twice, the
#      first fills the autotune cache, the second is issue 31's number
#  GB, GG  local engine MBS 4 mamba-scan: baseline, then compile_glue=true (now the MoE gather-sum alone)
# Everything lands in $OUT/r7.tgz.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-500} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
R=/tmp/r7 && mkdir -p $R
step 30 AC env PYTORCH_CUDA_ALLOC_CONF="$(python -c 'from nam_core.engine.megatron.checks import ALLOC_CONF, PINNED_CONF; print(f"{ALLOC_CONF},{PINNED_CONF}")')" \
  python -c 'import os, time, torch; x = torch.empty(1, device="cuda"); t = time.perf_counter(); y = torch.empty(2**31, dtype=torch.uint8, pin_memory=True); print(os.environ["PYTORCH_CUDA_ALLOC_CONF"], "pinned 2 GiB in", round(time.perf_counter() - t, 2), "s", y.is_pinned())'
cat "$OUT/AC.log" | tail -n 3 | tee -a "$OUT/$SUMMARY"
TRAIN=(--recipe nam56r --set train.micro_batch_size=4 --set train.recompute=mamba-scan --set train.checkpoint_every=0)
step 90 W3a nam train "${TRAIN[@]}" --max-steps 2 --run-dir $R/w3a --json
startup $R/w3a
step 80 W3b nam train "${TRAIN[@]}" --max-steps 2 --run-dir $R/w3b --json
startup $R/w3b
B=(python bench/megatron.py throughput --gpus 1 --engines local --mbs 4 --te none --recompute mamba-scan --warmup 1 --iters 3)
step 110 GB "${B[@]}" --json "$OUT/local_mbs4.json"
step 110 GG "${B[@]}" --train-set compile_glue=true --json "$OUT/local_mbs4_compile_glue.json"
grep -h "^| local" "$OUT/GB.log" "$OUT/GG.log" | tee -a "$OUT/$SUMMARY"
python - "$OUT/local_mbs4.json" "$OUT/local_mbs4_compile_glue.json" <<'PY' | tee -a "$OUT/$SUMMARY"
import json, sys
a, b = (json.load(open(p))["rows"][0] for p in sys.argv[1:])
print("tokens/s", round(a["tokens_per_s_per_gpu"]), "->", round(b["tokens_per_s_per_gpu"]), f"({b['tokens_per_s_per_gpu'] / a['tokens_per_s_per_gpu']:.3f}x)")
print("losses", a["losses"], b["losses"])
PY
tar -C "$OUT" -czf "$OUT/r7.tgz" $(cd "$OUT" && ls | grep -v -e '\.tgz$')
