#!/usr/bin/env bash
# Round 65, 2026-11-29 (ninth session), one H200, after `source gpu/host.sh`: what r64 did not run (its memcheck
# steps never started) and its last GPU test (cut by the step's limit).
#  SQ3   memcheck over mimo_fault.py: dq at NS 2, 3 stages, 16-token tiles, the other passes shipped
#  SS16  memcheck over the shipped set (dq at NS 2, 2 stages given), 16-token tiles
#  MPF   the plugin's last GPU test (the preflight launch)
# Result: SQ3 ok (worst relative error 1.82e-2), SS16 ok (1.79e-2), memcheck 0 errors in both; MPF passed (with r64's
# nine: the GPU tests 10 of 10 with the 3-stage dq in the tuner's list).
set -u
TOP=$OUT OUT=$OUT/r65 && mkdir -p "$OUT"  # only $TOP/r65.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-200} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
mc=("$san" --tool memcheck --kernel-name kns=bwd_kernel --print-limit 4 python gpu/mimo_fault.py)
show() { grep -E "^ok |ERROR SUMMARY|Out-of|Invalid|at bwd_kernel|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | head -n "${2:-8}" | tee -a "$OUT/$SUMMARY"; }
step 60 SQ3 "${mc[@]}" 4 3 --pass DQ --ns 2 --block-t 16; show SQ3
step 60 SS16 "${mc[@]}" 4 2 --pass DQ --ns 2 --block-t 16; show SS16
step 70 MPF python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider \
  -k preflight; show MPF
tar -C "$TOP" -czf "$TOP/r65.tgz" r65 && rm -rf "$OUT"
