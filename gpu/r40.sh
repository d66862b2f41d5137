#!/usr/bin/env bash
# Round 40 (2026-11-29, fourth session), one H200, right after r39 on the same machine when it is still warm, after
# `source gpu/host.sh`:
#  MB   bench/mimo_scan.py: mamba-ssm's static kernels against mimo-scan as committed, one run, 300 s a row (the
#       last same-run ratio, r35, predates r36's grid and this session's sums)
#  NCU  Nsight Compute over the per-head pass alone, its SASS page kept for gpu/ncu_lines.py (the after of r37)
set -u
TOP=$OUT OUT=$OUT/r40 && mkdir -p "$OUT"  # only $TOP/r40.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(mamba-ssm|mimo-scan)|passed|failed|FAILED|rror|Duration|Registers Per|Occupancy" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 330 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 300 --json "$OUT/mimo_scan_vs_static.json"; show MB 6
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
step 120 NCU "$NCU" --profile-from-start off --clock-control none --kernel-name regex:bwd_kernel --launch-count 1 \
  --import-source yes --section SourceCounters --section WarpStateStats --section Occupancy --section LaunchStats \
  --section SpeedOfLight -o "$OUT/perhead" -f python gpu/mimo_ncu.py
if [[ -f $OUT/perhead.ncu-rep ]]; then
  step 40 NCUS bash -c "'$NCU' -i '$OUT/perhead.ncu-rep' --page source --csv --print-source sass > '$OUT/sass.csv'"
  step 30 NCUD "$NCU" -i "$OUT/perhead.ncu-rep" --page details
  step 20 STALLS bash -c "python gpu/ncu_stalls.py '$OUT/sass.csv' > '$OUT/stalls.txt'"
  rm -f "$OUT/perhead.ncu-rep"
  gzip -f "$OUT/sass.csv"
  grep -E "Duration|Registers Per|Achieved Occupancy|Executed Ipc A|No Eligible" "$OUT/NCUD.log" >> "$OUT/$SUMMARY"
fi
tar -C "$TOP" -czf "$TOP/r40.tgz" r40 && rm -rf "$OUT"
