#!/usr/bin/env bash
# A record of what ran: the variants' flags (PF, GO; mimo_fault.py --go --pf) were removed after this round, each
# kept where it won (the dstate walk always loads ahead, dq / dk in windows load the group's q and k once, the state
# walk as before), so the script no longer runs as it stands. MF_DQ_32 ran out of its 40 s compiling; MP's last
# test (the preflight launch) was cut by the step's limit after 8 passed.
# Round 42 (2026-11-29, fourth session), one H200, after `source gpu/host.sh`. r41: fwd+bwd 21.77 ms (per head
# 6.48, dk 3.41, dq 2.74, dstate_walk 2.14, fwd_chunk 2.23, state_walk 1.07); its profile by line (gpu/ncu_lines.py)
# put dk's and dq's stalls on loads of the group's q / k (the same for all 16 heads of a group, loaded again for
# each) and the next head's phase table, and the walks' on the chunk's phase table and log-decays (a chain: each
# load waits out its latency). Now both are offered to the tuner as variants, timed against the r41 code in one
# run: the walks' PF 1 (the next chunk's table and log-decays loaded while this one computes), dq / dk's GO 1 (q
# and k once a program, the next head's table ahead).
#  MK   gpu/mimo_kernels.py: every variant's tuner time, the chosen ones, per-pass times, the results' digest
#  MF   the variants forced against the fp32 reference (gpu/mimo_fault.py), 16- and 32-token tiles: dq GO 1 at 4
#       warps 1 stage, dk GO 1 in 2 windows at 4 warps 2 stages, the walks PF 1
#  MP   the plugin's GPU tests
set -u
TOP=$OUT OUT=$OUT/r42 && mkdir -p "$OUT"  # only $TOP/r42.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|block_t|digest)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 120 MK python gpu/mimo_kernels.py; show MK 50
for c in "DQ 4 1 1" "DK 4 2 2"; do
  for bt in 16 32; do
    set -- $c
    step 40 "MF_$1_$bt" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py $2 $3 --pass $1 --ns $4 --go 1 --pf 1 \
      --block-t $bt; show "MF_$1_$bt" 2
  done
done
step 330 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 14
tar -C "$TOP" -czf "$TOP/r42.tgz" r42 && rm -rf "$OUT"
