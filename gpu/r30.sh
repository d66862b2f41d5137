#!/usr/bin/env bash
# Round 30 (2026-11-29), one H200, after `source gpu/host.sh`. nam's MIMO scan after the cos / sin table (the
# phase kernel writes cos and sin once; every other kernel reads them: the libdevice calls were most of each
# kernel's code) and the per-head pass's column-block loop:
#  MK  gpu/mimo_kernels.py: fwd, fwd+bwd, per-launch ms, the configs chosen
#  MP  the plugin's GPU tests in full: bf16 parity at NAM56R's widths, no host sync, capture, first call, preflight
#  NCU Nsight Compute over one forward + backward, as r29 (the details page and the stall summary)
set -u
TOP=$OUT OUT=$OUT/r30 && mkdir -p "$OUT"  # only $TOP/r30.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(fwd|launch|  chosen|first)|passed|failed|FAILED|Error|rror" "$OUT/$1.log" \
  | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 200 MK python gpu/mimo_kernels.py; show MK 24
step 220 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -q -s -p no:cacheprovider
show MP 30
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
step 100 NCU "$NCU" --profile-from-start off --clock-control none --kernel-name regex:'walk|chunk|bwd_kernel|phase' \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section SourceCounters -o "$OUT/mimo" -f python gpu/mimo_ncu.py; show NCU 10
if [[ -f $OUT/mimo.ncu-rep ]]; then
  step 40 NCUD "$NCU" -i "$OUT/mimo.ncu-rep" --page details
  step 60 NCUS "$NCU" -i "$OUT/mimo.ncu-rep" --page source --csv --print-source sass
  rm -f "$OUT/mimo.ncu-rep"
  grep -E "Duration|Registers Per|Achieved Occupancy|Executed Ipc A|No Eligible|_kernel" "$OUT/NCUD.log" >> "$OUT/$SUMMARY"
fi
tar -C "$TOP" -czf "$TOP/r30.tgz" r30 && rm -rf "$OUT"
