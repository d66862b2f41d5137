#!/usr/bin/env bash
# A record of what ran: --dq-dk-together (mimo_kernels.py) was removed after this round with the variant they tried (measured
# slower), so the script no longer runs as it stands.
# Round 37 (2026-11-29, third session), one H200, after `source gpu/host.sh`. r36: dq and dk in one launch
# faulted (illegal address) while the tuner timed it; gpu/mimo_fault.py found it matching the reference at 8 warps
# 1 stage in 2 windows (16- and 32-token tiles) and at 4 warps 2 stages in 4 windows (16), wrong (1.33) at 4 warps
# 1 stage in 4 windows (16) and faulting at 8 warps 1 stage in 4 windows (16) and 4 warps 1 stage in 4 (32):
#  MFS  dq and dk apart at 4 warps 1 stage in 4 windows, 16-token tiles: is it the windows at 1 stage, or the
#       shared launch?
#  MKT  the shared launch timed at the configs found right (and the per-head pass's 4 warps 2 stages)
#  NCU  Nsight Compute over the per-head pass alone, with the source counters: stalls by instruction and line
set -u
TOP=$OUT OUT=$OUT/r37 && mkdir -p "$OUT"  # only $TOP/r37.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-400} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|block_t)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
for p in DQ DK; do
  step 40 "MFS_$p" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py 4 1 --pass $p --ns 4 --block-t 16
  show "MFS_$p" 2
done
step 90 MKT python gpu/mimo_kernels.py --dq-dk-together --bwd-configs 4,2 8,1,2 4,2,4; show MKT 30
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
step 120 NCU "$NCU" --profile-from-start off --clock-control none --kernel-name regex:bwd_kernel --launch-count 1 \
  --import-source yes --section SourceCounters --section WarpStateStats --section Occupancy --section LaunchStats \
  --section SpeedOfLight -o "$OUT/perhead" -f python gpu/mimo_ncu.py
if [[ -f $OUT/perhead.ncu-rep ]]; then
  step 40 NCUS bash -c "'$NCU' -i '$OUT/perhead.ncu-rep' --page source --csv --print-source sass > '$OUT/sass.csv'"
  step 40 NCUC bash -c "'$NCU' -i '$OUT/perhead.ncu-rep' --page source --csv --print-source cuda > '$OUT/cuda.csv'"
  step 30 NCUD "$NCU" -i "$OUT/perhead.ncu-rep" --page details
  step 20 STALLS bash -c "python gpu/ncu_stalls.py '$OUT/sass.csv' > '$OUT/stalls.txt'"
  rm -f "$OUT/perhead.ncu-rep"
  gzip -f "$OUT/sass.csv" "$OUT/cuda.csv" 2>/dev/null
  grep -E "Duration|Registers Per|Achieved Occupancy|Executed Ipc A|No Eligible" "$OUT/NCUD.log" >> "$OUT/$SUMMARY"
fi
ls -la "$OUT" >> "$OUT/$SUMMARY"
tar -C "$TOP" -czf "$TOP/r37.tgz" r37 && rm -rf "$OUT"
