#!/usr/bin/env bash
# Round 43, prepared 2026-11-29 (fifth session, which had no device time left to run it), one H200, after
# `source gpu/host.sh`. r42: fwd+bwd 20.44 ms, the per-head pass 6.49 of it; r41's profile by line put 18% of the
# per-head pass's stall samples on its row loads (x, dout, z: each token's row loaded once per rank; ncu 36%
# excess sectors), and the pass loads those rows twice: whole before its column loop (for dL/dM) and by column
# block in it. Two switches, environment variables read at import (global constexprs, so each setting compiles
# into its own Triton cache), for this round only; each kernel keeps the faster by its launch time:
#  - NAM_MIMO_FOLD=1: the per-head pass forms dL/dM block by block in its column loop from the rows it loads there
#    (offline sm_90 at 4 warps 2 stages: 4,608 -> 3,752 SASS instructions, 0 -> 44 B of spills);
#  - NAM_MIMO_ONCE=1: every kernel loads a token's row once and repeats it over the ranks in registers (per-head
#    pass 4,608 -> 4,248; with FOLD 3,688 and 16 B of spills; dstate walk 204 -> 312 B of spills).
#  MK0   gpu/mimo_kernels.py as committed
#  MKF   NAM_MIMO_FOLD=1 (only the per-head pass differs)
#  MKFO  NAM_MIMO_FOLD=1 NAM_MIMO_ONCE=1 (every kernel's ONCE against MKF's, the per-head pass's both together)
#  MF    FOLD and ONCE together against the fp32 reference (gpu/mimo_fault.py: the per-head pass at the 4 warps,
#        2 stages it takes; 16- and 32-token tiles), FOLD alone at 32
#  MKO   NAM_MIMO_ONCE=1 alone, if time is left (the per-head pass's ONCE without FOLD)
# Then (r44, on the code with the winners kept and the switches gone): bench/mimo_scan.py against mamba-ssm's
# static kernels in one run, and the plugin's GPU tests.
set -u
TOP=$OUT OUT=$OUT/r43 && mkdir -p "$OUT"  # only $TOP/r43.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-570} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|digest)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 120 MK0 python gpu/mimo_kernels.py; show MK0 40
step 120 MKF env NAM_MIMO_FOLD=1 TRITON_CACHE_DIR=/tmp/tc-f python gpu/mimo_kernels.py; show MKF 40
step 120 MKFO env NAM_MIMO_FOLD=1 NAM_MIMO_ONCE=1 TRITON_CACHE_DIR=/tmp/tc-fo python gpu/mimo_kernels.py; show MKFO 40
for v in "FO 16 1" "FO 32 1" "F 32 0"; do
  set -- $v
  step 45 "MF_$1_$2" env NAM_MIMO_FOLD=1 NAM_MIMO_ONCE=$3 TRITON_CACHE_DIR=/tmp/tc-mf$1 CUDA_LAUNCH_BLOCKING=1 \
    python gpu/mimo_fault.py 4 2 --pass CHUNK --block-t $2; show "MF_$1_$2" 2
done
step 120 MKO env NAM_MIMO_ONCE=1 TRITON_CACHE_DIR=/tmp/tc-o python gpu/mimo_kernels.py; show MKO 40
tar -C "$TOP" -czf "$TOP/r43.tgz" r43 && rm -rf "$OUT"
