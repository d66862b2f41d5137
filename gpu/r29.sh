#!/usr/bin/env bash
# Round 29 (2026-11-29, second session), one H200, after `source gpu/host.sh`. Where nam's MIMO scan spends its
# time, by hardware counters, before the redesign:
#  MK  gpu/mimo_kernels.py: per-launch ms and the config the tuner chose for each pass (kernels.CONFIGS["bwd"]:
#      8, 4, 16 warps and 8 warps with 2 stages)
#  NCU Nsight Compute over one forward + backward (gpu/mimo_ncu.py): speed of light, occupancy, launch stats,
#      warp states, memory and compute workload, source counters; the details page and the per-instruction
#      source page of each kernel as text
# Everything lands in $OUT/r29.tgz; the kernel caches in $OUT/kcache.tgz.
set -u
TOP=$OUT OUT=$OUT/r29 && mkdir -p "$OUT"  # only $TOP/r29.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(fwd|launch|  chosen|first)|passed|failed|FAILED|Error|rror" "$OUT/$1.log" \
  | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 240 MK python gpu/mimo_kernels.py; show MK 24
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
log "ncu: $NCU"
step 200 NCU "$NCU" --profile-from-start off --clock-control none --kernel-name regex:'walk|chunk|bwd_kernel' \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section SourceCounters --import-source yes -o "$OUT/mimo" -f python gpu/mimo_ncu.py; show NCU 10
if [[ -f $OUT/mimo.ncu-rep ]]; then
  step 60 NCUD "$NCU" -i "$OUT/mimo.ncu-rep" --page details
  step 90 NCUS "$NCU" -i "$OUT/mimo.ncu-rep" --page source --csv --print-source sass
  grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Memory Throughput|Compute \(SM\)|bwd_kernel|walk_kernel|chunk_kernel|Stall" \
    "$OUT/NCUD.log" | head -120 >> "$OUT/$SUMMARY"
fi
kcache_pack
tar -C "$TOP" -czf "$TOP/r29.tgz" r29 && rm -rf "$OUT"
