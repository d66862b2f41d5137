#!/usr/bin/env bash
# Round 44, 2026-11-29 (sixth session), one H200, after `source gpu/host.sh`. r43 timed the per-head pass's two
# variants per launch (gpu/mimo_kernels.py, H200, NAM56R's b2): each token's row loaded once and repeated over the
# ranks (ONCE) 6.48 -> 5.77 ms; dL/dM formed in the column loop (FOLD) 7.46, with ONCE 5.93; ONCE slower in the
# walks, the forward and dk. The code now has the per-head pass's ONCE only (`kernels._token_rows`), the switches
# gone; offline sm_90 every pass compiles to the SASS r43 timed (the per-head pass to MKO's, the others to MK0's).
#  MK   gpu/mimo_kernels.py on that code (per launch, fwd+bwd, tuning left every tensor bit-identical)
#  MF   the per-head pass at the 4 warps, 2 stages it takes against the fp32 reference, 16- and 32-token tiles
#       (FOLD with ONCE faulted at 32 in r43; FOLD alone did not)
#  MB   bench/mimo_scan.py: mamba-ssm's static kernels and nam's in one run (the same-run ratio)
# r45: the plugin's GPU tests.
set -u
TOP=$OUT OUT=$OUT/r44 && mkdir -p "$OUT"  # only $TOP/r44.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(mamba-ssm|mimo-scan)|^(ok|fwd|launch|first|digest)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 100 MK python gpu/mimo_kernels.py; show MK 12
for bt in 16 32; do
  step 45 "MF_$bt" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py 4 2 --pass CHUNK --block-t $bt; show "MF_$bt" 2
done
step 330 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 300 --json "$OUT/mimo_scan_vs_static.json"; show MB 6
tar -C "$TOP" -czf "$TOP/r44.tgz" r44 && rm -rf "$OUT"
