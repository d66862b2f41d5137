#!/usr/bin/env bash
# Round 68b, 2026-12-07 (eleventh session), the machine of r68 (warm) or a fresh one, after `source gpu/host.sh`.
#  MB4R  bench/mimo_scan.py at b4 (the MBS the local engine's recipe runs, under train.recompute=mamba-scan):
#        mamba-ssm static against mimo-scan, each row's scan under nam's activation checkpoint (--recompute); the
#        static kernels build for b4 here (not in the cache)
# Result (H200, warm after r68, ran BUDGET=300): static 5.05 / 26.61 / 31.65 ms fwd / bwd / total, mimo-scan
# 7.41 / 26.65 / 34.06 (0.93x); the static b4 build 148 s on first call.
set -u
TOP=$OUT OUT=$OUT/r68b && mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-480} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\| |rror|Traceback" "$OUT/$1.log" | head -n "${2:-30}" | tee -a "$OUT/$SUMMARY"; }
step 460 MB4R python bench/mimo_scan.py --batch 4 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 300 --recompute --json "$OUT/mimo_scan_b4_recompute.json"; show MB4R
tar -C "$TOP" -czf "$TOP/r68b.tgz" r68b && rm -rf "$OUT"
