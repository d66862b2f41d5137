#!/usr/bin/env bash
# Round 63, 2026-11-29 (ninth session), one H200, after `source gpu/host.sh`: where r62's 3-stage dq window
# faults (an illegal memory access at 16-token tiles, b1, l=1000), and whether the shipped configs read or write
# out of bounds at that shape: Compute Sanitizer's memcheck over gpu/mimo_fault.py (one backward config each).
#  SQ2  dq at NS 2, 2 stages (the config the tuner takes)
#  SQ3  dq at NS 2, 3 stages (r62's fault)
#  SH   the per-head pass at its cap (4 warps, 2 stages, 168 registers)
# Result: SQ2 and SQ3 both: "Out-of-range shared or local address" at kernels.py:431 (`_head_cols`, the S_in load
# for the dot with q~) in the per-head pass, which mimo_fault.py ran at 4 warps, 1 stage (not a config the tuner
# offers it); dq itself was never reached. SH (the per-head pass at its cap, dq / dk at 4 warps 1 stage NS 1): ok,
# worst relative error 1.68e-2, memcheck 0 errors.
set -u
TOP=$OUT OUT=$OUT/r63 && mkdir -p "$OUT"  # only $TOP/r63.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-300} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -1)
log "sanitizer: ${san:-none}"
show() { grep -E "^ok |ERROR SUMMARY|Invalid|at .*kernels.py|by thread|Address|rror" "$OUT/$1.log" | head -n "${2:-16}" \
  | tee -a "$OUT/$SUMMARY"; }
step 100 SQ2 "$san" --tool memcheck --kernel-name kns=bwd_kernel --print-limit 4 python gpu/mimo_fault.py 4 2 --pass DQ --ns 2 --block-t 16; show SQ2
step 100 SQ3 "$san" --tool memcheck --kernel-name kns=bwd_kernel --print-limit 4 python gpu/mimo_fault.py 4 3 --pass DQ --ns 2 --block-t 16; show SQ3
step 100 SH "$san" --tool memcheck --kernel-name kns=bwd_kernel --print-limit 4 python gpu/mimo_fault.py 4 2 --pass CHUNK --maxnreg 168 --block-t 16; show SH
tar -C "$TOP" -czf "$TOP/r63.tgz" r63 && rm -rf "$OUT"
