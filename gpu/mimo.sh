#!/usr/bin/env bash
# Issue 32 part 1 on the GPU host: nam's MIMO scan at NAM56R's shape. Run from the repository root:
#   bash gpu/mimo.sh        (OUT defaults to ./gpu-out; the whole run stays under 4 minutes)
# 1. the plugin's GPU tests (bf16 parity at NAM56R's widths, no host sync, capture, first call == second, preflight)
# 2. per launch ms (each bwd pass), autotuner timings per config, registers / spills / shared memory
# 3. nam's scan alone in bench/mimo_scan.py at b2 x 4096 (fwd / bwd ms) + torch.profiler table of its kernels
# 4. where capture breaks (gpu/mimo_capture.py) if its test failed; parity at l=4096
# 5. mamba-ssm's static kernels against nam's in one run (same GPU, as a ratio), if time is left
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site}
export PYTHONUNBUFFERED=1
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"  # left, limit, log, step
BUDGET=232 STEP_MIN=15 STEP_EXT=.log
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# correctness first: parity (ngroups 1, 8, 128), no host sync, CUDA-graph capture, first call == second, preflight
step 110 gpu-tests python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -q -s \
  -p no:cacheprovider -k "not 8-32"
grep -E "^(g=|  norm|worst|[0-9]+ (passed|failed)|FAILED|E )" "$OUT/gpu-tests.log" | head -n 30
tail -n 3 "$OUT/gpu-tests.log"

step 80 kernels python gpu/mimo_kernels.py  # per launch ms, autotune timings, registers / spills / shared memory
cat "$OUT/kernels.log" | tail -n 60

step 50 bench-mimo python bench/mimo_scan.py --batch 2 --rows mimo-scan --baseline mimo-scan --warmup 2 \
  --iters 5 --timeout 45 --profile "$OUT/prof" --json "$OUT/bench-mimo.json"
tail -n 8 "$OUT/bench-mimo.log"
cat "$OUT"/prof/mimo-scan-mimo-scan-b2.txt 2>/dev/null | head -20

if grep -q "FAILED.*capture" "$OUT/gpu-tests.log" 2>/dev/null; then  # where capture breaks, in relaxed mode too
  step 30 capture-fwdbwd python gpu/mimo_capture.py fwdbwd global
  step 30 capture-fwdbwd-relaxed python gpu/mimo_capture.py fwdbwd relaxed
  grep -h -E "^capture|Error" "$OUT"/capture-*.log | head -n 12
fi

step 45 parity-4096 python -c "
import torch
from nam_plugin_mimo_scan.selftest import compare
e = compare(1, 4096, 128, 8, 128, 64, 4, device='cuda', norms=True)
seed, norm = e.pop('seed'), e.pop('norm')
print('b1 l4096 h128 g8 seed', seed, 'worst max-rel', max(e.values()), 'worst norm-rel', max(norm.values()))
print('max:', ' '.join(f'{k}={v:.1e}' for k, v in e.items()))
print('norm:', ' '.join(f'{k}={v:.1e}' for k, v in norm.items()))"
tail -n 3 "$OUT/parity-4096.log"

step 120 bench-vs-static python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan \
  --baseline mamba-ssm-static --warmup 2 --iters 5 --timeout 100 --json "$OUT/bench-vs-static.json"
tail -n 8 "$OUT/bench-vs-static.log"
echo "total ${SECONDS}s"
