#!/usr/bin/env bash
# Issue 32 item 2 on the GPU host: sparse-mla's sparse MLA and index-score kernels. From the repository root:
#   bash gpu/smla.sh        (OUT defaults to ./gpu-out; the whole run stays under 3 minutes)
# 1. before/after and tile variants of both kernels, dense SDPA, a profile (gpu/smla_bench.py -> smla_bench.json)
# 2. the plugin's GPU tests (bf16 parity at NAM56R's shapes, no host syncs, capture, preflight)
# 3. bench/sparse_mla.py (sparse-mla vs dense SDPA, same run), bench/indexer.py at b=2 (reference vs Triton)
# 4. the GPU tests' tiny model step (nam56r-tiny on the kernels against the reference core)
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site}
export PYTHONUNBUFFERED=1
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # left, limit, log, step
BUDGET=${BUDGET:-170} STEP_MIN=10 STEP_EXT=.log
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

step 80 bench-variants python gpu/smla_bench.py "$OUT"
grep -v "^-\|^ *Name\|^$" "$OUT/bench-variants.log" | head -n 60

step 50 gpu-tests python -m pytest -m gpu plugins/nam-plugin-sparse-mla/tests -q -s -p no:cacheprovider \
  -k "not tiny_model_step"
grep -E "(seed=|b=[0-9]|dense|peak|[0-9]+ (passed|failed)|FAILED|Error|E  )" "$OUT/gpu-tests.log" | head -n 30
tail -n 3 "$OUT/gpu-tests.log"

step 22 bench-sparse-mla python bench/sparse_mla.py --warmup 2 --iters 10 --json "$OUT/sparse_mla.json"
tail -n 6 "$OUT/bench-sparse-mla.log"
step 18 bench-indexer python bench/indexer.py --batch 2 --warmup 2 --iters 10 --json "$OUT/indexer.json"
tail -n 6 "$OUT/bench-indexer.log"
step 40 gpu-tests-model python -m pytest -m gpu plugins/nam-plugin-sparse-mla/tests -q -s -p no:cacheprovider \
  -k "tiny_model_step"
tail -n 3 "$OUT/gpu-tests-model.log"
echo "== done at ${SECONDS}s"
