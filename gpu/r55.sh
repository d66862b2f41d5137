#!/usr/bin/env bash
# Round 55, 2026-11-29 (eighth session), one H200, after `source gpu/host.sh`: the per-head pass offered 4 warps,
# 2 stages capped at 168 registers (r54: 5.15 ms against 5.85 uncapped, three programs an SM).
#  MKA  gpu/mimo_kernels.py as the plugin now tunes (the per-head pass expected to take the cap)
#  MKB  the same with the backward offered only the uncapped (4, 2) configs: the digest must equal MKA's (a cap on
#       registers changes no arithmetic; the inputs and dout are seeded since this round)
#  MKS  a sweep: dq / dk at 8 warps NS 2 (capped 128 or not), fwd_chunk at 8 warps capped 128, both walks at 8
#       warps capped 128 (1 and 2 stages) against their 4-warp configs
#  F16, F32  gpu/mimo_fault.py: the per-head pass at (4, 2, 168) against the fp32 reference, 16- and 32-token tiles
#  MP   the plugin's GPU tests
# Result: MKA 17.51 ms fwd+bwd (per head 5.02) against MKB 18.34 (5.72), the same digest 85d88b6746c5ee36 in all
# three; nothing in the sweep beat the configs in place; F16 / F32 ok (worst 1.9e-2); the GPU tests 10 passed (184 s).
set -u
TOP=$OUT OUT=$OUT/r55 && mkdir -p "$OUT"  # only $TOP/r55.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(mamba-ssm|mimo-scan)|^(fwd|launch|first|digest|block_t|tuned|ok )|best|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 80 MKA python gpu/mimo_kernels.py; show MKA 14
step 70 MKB python gpu/mimo_kernels.py --bwd-configs 4,2,1,0 4,2,2,0; show MKB 14
step 90 MKS python gpu/mimo_kernels.py --bwd-configs 4,2,1,168 4,2,2,0 8,2,2,128 8,2,2,0 \
  --chunk-configs 4,1,168 8,1,128 --walk-configs 4,1,1 8,1,1,128 8,2,1,128; show MKS 40
step 50 F16 python gpu/mimo_fault.py 4 2 --pass CHUNK --maxnreg 168 --block-t 16; show F16 2
step 50 F32 python gpu/mimo_fault.py 4 2 --pass CHUNK --maxnreg 168 --block-t 32; show F32 2
step 260 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 16
tar -C "$TOP" -czf "$TOP/r55.tgz" r55 && rm -rf "$OUT"
