#!/usr/bin/env bash
# Round 46, 2026-11-29 (sixth session), one H200, after `source gpu/host.sh`: where r44's fwd+bwd (19.52 ms; the
# seven launches 16.0 of it) goes now, for the next round:
#  PROF  bench/mimo_scan.py --profile: nam's per-kernel CUDA time of one forward + backward at b2, the torch glue
#        between the launches included (the launches sum to ~3.5 ms less than fwd+bwd)
#  NCU   Nsight Compute over a step's seven scan launches (ncu_profile in gpu/lib.sh: SASS page, details, stalls)
set -u
TOP=$OUT OUT=$OUT/r46 && mkdir -p "$OUT"  # only $TOP/r46.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
step 150 PROF python bench/mimo_scan.py --batch 2 --rows mimo-scan --baseline mimo-scan --warmup 2 --iters 5 \
  --timeout 140 --profile "$OUT/prof"
grep -E "^\|.*mimo-scan|rror" "$OUT/PROF.log" | tee -a "$OUT/$SUMMARY"
ncu_profile NCU "bwd_kernel|walk|fwd_chunk" 7 150 python gpu/mimo_ncu.py
tar -C "$TOP" -czf "$TOP/r46.tgz" r46 && rm -rf "$OUT"
