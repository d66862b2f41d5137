#!/usr/bin/env bash
# Round 48, 2026-11-29 (sixth session), one H200, after `source gpu/host.sh`; the session's last ~270 s of device
# time. r47's profile: the phase kernel (now with the log-decay's tile cumsum) 0.38 ms a call, twice a step, one
# walk of the whole sequence per (b, h) (256 programs at b2). It now runs up to 8 programs per (b, h), each summing
# the rate over the tokens before its segment and walking its 512 tokens.
#  MK    gpu/mimo_kernels.py (per launch, fwd+bwd)
#  PROF  bench/mimo_scan.py --profile, nam's row only: the phase kernel's time
#  MF    the per-head pass against the fp32 reference (b1, l1000, h128, g8: the phase in 2 segments of 512)
# Result: the phase kernel 0.374 ms a call against r47's 0.381 (fwd+bwd 18.92 against 18.98): it is not the walk's
# latency that costs, so the segments were reverted (`git revert` of the commit that ran here); the kernel to be
# profiled (ncu) before it is changed again.
set -u
TOP=$OUT OUT=$OUT/r48 && mkdir -p "$OUT"  # only $TOP/r48.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-150} STEP_MIN=15 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*mimo-scan|^(ok|fwd|launch|first|digest)|phase_kernel|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 70 MK python gpu/mimo_kernels.py; show MK 12
step 30 MF env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py 4 2 --pass CHUNK --block-t 16; show MF 2
step 40 PROF python bench/mimo_scan.py --batch 2 --rows mimo-scan --baseline mimo-scan --warmup 2 --iters 5 \
  --timeout 35 --profile "$OUT/prof"; show PROF 3; grep -h phase_kernel "$OUT"/prof/*.txt | tee -a "$OUT/$SUMMARY"
tar -C "$TOP" -czf "$TOP/r48.tgz" r48 && rm -rf "$OUT"
