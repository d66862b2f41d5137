#!/bin/bash
# GPU round for the te branch (issue 29 part 1), on the host with Transformer Engine 2.20.2 installed into
# /tmp/site (GPU-PROTOCOL.md). Steps, each bounded so the whole ends within ~4 minutes (the smokes of 4 and 5
# run in the background while 1 and 2 run; 3 runs alone at the end):
#   1. nam preflight --plugins te (every row should pass), and the gb10 profile's refusal
#   2. the plugin's GPU tests (bf16 and FP8 parity, the tiny model with TE linears)
#   3. bench/te_linear.py: 16384x4096 -> 16384 forward + backward, torch bf16 / TE bf16 / FP8 current, delayed,
#      blockwise
#   4. smokes, 3 steps of nam56r-tiny on CUDA in bf16 (mamba_rope_fraction=1.0: every projection divisible by 16):
#      local engine with TE FP8 linears (current scaling); megatron engine (--nproc 1) with TE FP8 (current) and
#      Megatron's TE modules; megatron engine with TEGroupedMLP experts in bf16
#      and TEGroupedMLP in FP8 with FP8 weights all-gathered (te.fp8_param_gather)
#   5. nam preflight with a run (te.fp8=delayed: the run's recipe rows)
set -uo pipefail
OUT=${OUT:-/tmp/te-out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # left, limit, log, step
BUDGET=235 STEP_MIN=10 STEP_EXT=.txt STEP_TAIL=25 SUMMARY=summary.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
git log --oneline -1 | tee -a "$OUT/gpu.txt"
python3 -c "from nam_core.cudnn import torch_cudnn_dir; print('torch cuDNN', torch_cudnn_dir())" | tee -a "$OUT/gpu.txt"
TINY=(--recipe nam56r-tiny --device cuda --set train.dtype=bfloat16 --set mamba_rope_fraction=1.0 --max-steps 3
      --set attention_backend=reference --plugins te)
# The smokes are tiny models: they run in the background, side by side with the preflight and the tests (torchrun
# --standalone picks free ports; the default corpus is prepared atomically); the benchmark runs alone at the end.
lim=150
bg() {  # name, command...: in the background, output to $OUT/name.txt, its exit status as the last line
  local name=$1; shift
  ( timeout "$lim" "$@" > "$OUT/$name.txt" 2>&1; echo "rc=$?" >> "$OUT/$name.txt" ) &
}
SMOKES=(local-fp8 megatron-fp8 megatron-grouped megatron-fp8-gather preflight-run)
bg local-fp8 nam train "${TINY[@]}" --set te.fp8=current --run-dir /tmp/te-local-fp8
bg megatron-fp8 nam train "${TINY[@]}" --engine megatron --nproc 1 --set te.fp8=current --run-dir /tmp/te-meg-fp8
bg megatron-grouped nam train "${TINY[@]}" --engine megatron --nproc 1 --set te.experts=grouped \
  --run-dir /tmp/te-meg-grouped
bg megatron-fp8-gather nam train "${TINY[@]}" --engine megatron --nproc 1 --set te.experts=grouped \
  --set te.fp8=current --set te.fp8_param_gather=true --run-dir /tmp/te-meg-gather
bg preflight-run nam preflight --plugins te --recipe nam56r-tiny --device cuda --set train.dtype=bfloat16 \
  --set mamba_rope_fraction=1.0 --set attention_backend=reference --set te.fp8=delayed
log "smokes started in the background (limit $lim s each)"
step 60 preflight nam preflight --plugins te
step 20 preflight-gb10 nam preflight --plugins te --device-profile gb10
step 100 gpu-tests python3 -m pytest -m gpu plugins/nam-plugin-te/tests/test_te_gpu.py -q -s -p no:cacheprovider
wait
for name in "${SMOKES[@]}"; do
  echo "---- $name"; tail -n 18 "$OUT/$name.txt"; log "$name $(tail -n 1 "$OUT/$name.txt")"
done
step 45 bench-linear python3 bench/te_linear.py --json "$OUT/te_linear.json"
log "done"
