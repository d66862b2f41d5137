#!/usr/bin/env bash
# Round 32 (2026-11-29), one H200, after `source gpu/host.sh`. nam's MIMO scan with the cos / sin table read per
# token (the walks' shared memory 123 -> 99 KB: two programs an SM), the per-head pass back at 2 stages:
#  MF  r31's non-finite per-head gradients at 32-token tiles: the per-head pass at 4, 8 and 16 warps with 1 stage,
#      one process each, CUDA_LAUNCH_BLOCKING=1 (gpu/mimo_fault.py)
#  MP  the plugin's GPU tests in full (the 32-token case last)
#  MK  gpu/mimo_kernels.py: fwd, fwd+bwd, per-launch ms, every pass's tuner timings
#  NCU Nsight Compute over one forward + backward, the details page
set -u
TOP=$OUT OUT=$OUT/r32 && mkdir -p "$OUT"  # only $TOP/r32.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=25 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first)|passed|failed|FAILED|rror" "$OUT/$1.log" \
  | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
for cfg in "4 1" "8 1" "16 1"; do
  step 45 "MF${cfg// /_}" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py $cfg --pass CHUNK
  show "MF${cfg// /_}" 3
done
step 60 MK python gpu/mimo_kernels.py; show MK 60
step 250 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider \
  -k "not 8-32"; show MP 10
step 50 MP32 python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -q -p no:cacheprovider \
  -k "8-32"; show MP32 4
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
step 60 NCU "$NCU" --profile-from-start off --clock-control none --kernel-name regex:'walk|chunk|bwd_kernel' \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section ComputeWorkloadAnalysis -o "$OUT/mimo" -f python gpu/mimo_ncu.py
if [[ -f $OUT/mimo.ncu-rep ]]; then
  step 25 NCUD "$NCU" -i "$OUT/mimo.ncu-rep" --page details
  rm -f "$OUT/mimo.ncu-rep"
  grep -E "Duration|Registers Per|Achieved Occupancy|Executed Ipc A|No Eligible|_kernel" "$OUT/NCUD.log" >> "$OUT/$SUMMARY"
fi
tar -C "$TOP" -czf "$TOP/r32.tgz" r32 && rm -rf "$OUT"
