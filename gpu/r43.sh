#!/usr/bin/env bash
# Round 43 (2026-11-29, fifth session), one H200, after `source gpu/host.sh`. r42: fwd+bwd 20.44 ms; r41's profile by
# line put 18% of the per-head pass's stall samples on its row loads (x, dout, z: each token's row loaded once per
# rank, ncu 36% excess sectors). kernels.NAM_MIMO_ONCE=1 (an environment switch for this round) loads each token's
# row once and repeats it over the ranks in registers, in every kernel; each kernel keeps the faster by its launch
# time (offline sm_90: per-head pass 4,608 -> 4,256 SASS instructions, no spills; the dstate walk 204 -> 312 B of
# spills). Also the same-run ratio against mamba-ssm's static kernels the final code of r42 lacks.
#  MK0  gpu/mimo_kernels.py as committed (ONCE 0)
#  MK1  the same with NAM_MIMO_ONCE=1 (its own Triton cache: the switch is a global constexpr)
#  MF   NAM_MIMO_ONCE=1 against the fp32 reference (gpu/mimo_fault.py: the per-head pass at the 4 warps, 2 stages it
#       takes; 16- and 32-token tiles)
#  MB   bench/mimo_scan.py: mamba-ssm's static kernels against mimo-scan as committed, one run
set -u
TOP=$OUT OUT=$OUT/r43 && mkdir -p "$OUT"  # only $TOP/r43.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|digest)|^\|.*(mamba-ssm|mimo-scan)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 120 MK0 python gpu/mimo_kernels.py; show MK0 40
step 120 MK1 env NAM_MIMO_ONCE=1 TRITON_CACHE_DIR=/tmp/tc-once python gpu/mimo_kernels.py; show MK1 40
for bt in 16 32; do
  step 45 "MF_$bt" env NAM_MIMO_ONCE=1 TRITON_CACHE_DIR=/tmp/tc-once CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py \
    4 2 --pass CHUNK --block-t $bt; show "MF_$bt" 2
done
step 330 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 300 --json "$OUT/mimo_scan_vs_static.json"; show MB 6
tar -C "$TOP" -czf "$TOP/r43.tgz" r43 && rm -rf "$OUT"
