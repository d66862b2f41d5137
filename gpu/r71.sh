#!/usr/bin/env bash
# Round 71 (2026-12-07, twentieth session), one GPU (an H100 is enough), after `source gpu/host.sh` with the full
# stack bundle and r66's kernel pack (.kcache/kcache.tgz: the b2 builds). Run: carry .device-wheels/site.tar.xz,
# .device-wheels/install.sh, .kcache/kcache.tgz; command `export OUT && source gpu/host.sh && BUDGET=160 bash
# gpu/r71.sh`.
# The nineteenth session changed GPU-only paths that CPU CI skips (lemyx's parity self-test and liger's launch
# comparison count a non-finite error as inf; liger's launch row names its chunking and refuses mixed dtypes;
# sparse-mla and lemyx gained dtype rows): this round runs them on a GPU.
#  P  `nam preflight --recipe nam56r --set train.micro_batch_size=2 --json`: every row of the recipe's plugins on
#     this GPU (lemyx's self-test among them); the memory rows may refuse on an 80 GB card, which is their job
#  T  the GPU tests of lemyx and liger (their preflight launch rows among them); T2 hopper-ce's and sparse-mla's
#     (both files) with what time is left; verbose, so a run cut by the budget still shows each test that finished
set -u
TOP=$OUT OUT=$OUT/r71 && mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-160} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "PASSED|FAILED|ERROR|passed|failed|rror|Traceback|\"status\"|\"ok\"" "$OUT/$1.log" | head -n "${2:-60}" | tee -a "$OUT/$SUMMARY"; }
log "GPU $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
step 150 T python -m pytest -m gpu -v -rA plugins/nam-plugin-lemyx/tests/test_lemyx_gpu.py \
  plugins/nam-plugin-liger/tests/test_liger_gpu.py; show T 40
step 110 P nam preflight --recipe nam56r --set train.micro_batch_size=2 --json; show P 80
step 200 T2 python -m pytest -m gpu -v -rA plugins/nam-plugin-hopper-ce/tests/test_hopper_ce_gpu.py \
  plugins/nam-plugin-sparse-mla/tests/test_sparse_mla_gpu.py plugins/nam-plugin-sparse-mla/tests/test_indexer_kernels_gpu.py
show T2 40
tar -C "$TOP" -czf "$TOP/r71.tgz" r71 && rm -rf "$OUT"
