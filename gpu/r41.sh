#!/usr/bin/env bash
# Round 41 (2026-11-29, fourth session), one H200, after `source gpu/host.sh`. r39/r40: the per-head pass 7.65 ->
# 6.78 ms (the pass as helpers, its sums before its stores); the scan 0.71x of mamba-ssm's static kernels in one
# run. r40's profile by line (gpu/ncu_lines.py) put 12% of the per-head pass's stall samples in tl.sigmoid
# (div.full: ~20 SASS instructions an element); now kernels._sigmoid is ex2.approx + rcp.approx (offline, sm_90:
# per head 5,264 -> 4,608 SASS instructions, fwd_chunk 2,832 -> 2,576, dstate_walk at 8 warps 1,592 -> 1,464).
#  MK   gpu/mimo_kernels.py: per-pass times and the results' digest
#  MP   the plugin's GPU tests, with the new one of _sigmoid against tl.sigmoid and float64
#  NCU  Nsight Compute over one forward + backward's seven scan launches (state_walk, fwd_chunk, state_walk,
#       dstate_walk, the three bwd passes), their SASS pages kept for gpu/ncu_lines.py
set -u
TOP=$OUT OUT=$OUT/r41 && mkdir -p "$OUT"  # only $TOP/r41.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|block_t|digest|chosen)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 110 MK python gpu/mimo_kernels.py; show MK 40
step 260 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 14
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
step 150 NCU "$NCU" --profile-from-start off --clock-control none --kernel-name regex:"bwd_kernel|walk|fwd_chunk" \
  --launch-count 7 --import-source yes --section SourceCounters --section WarpStateStats --section Occupancy \
  --section LaunchStats --section SpeedOfLight -o "$OUT/scan" -f python gpu/mimo_ncu.py; show NCU 4
if [[ -f $OUT/scan.ncu-rep ]]; then
  step 60 NCUS bash -c "'$NCU' -i '$OUT/scan.ncu-rep' --page source --csv --print-source sass > '$OUT/sass.csv'"
  step 30 NCUD "$NCU" -i "$OUT/scan.ncu-rep" --page details
  step 20 STALLS bash -c "python gpu/ncu_stalls.py '$OUT/sass.csv' > '$OUT/stalls.txt'"
  rm -f "$OUT/scan.ncu-rep"
  gzip -f "$OUT/sass.csv"
  grep -E "^  [a-z_]+kernel|Duration|Registers Per|Achieved Occupancy|Block Size|Grid Size" "$OUT/NCUD.log" >> "$OUT/$SUMMARY"
fi
tar -C "$TOP" -czf "$TOP/r41.tgz" r41 && rm -rf "$OUT"
