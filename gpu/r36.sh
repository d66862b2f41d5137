#!/usr/bin/env bash
# A record of what ran: --dq-dk-together (mimo_kernels.py) and --pass DQDK (mimo_fault.py) were removed after this round with the variant they tried (measured
# slower), so the script no longer runs as it stands.
# Round 36 (2026-11-29, third session), one H200, after `source gpu/host.sh`. r35: capping registers (maxnreg)
# made every kernel slower; static 15.84 ms against nam's 23.41 in one run (0.68x). Since: dq / dk's windows of a
# chunk are adjacent programs (grid (nc*NS, b*g)), so all but the first read the hand-off from L2, and dq and dk
# may share one launch (offline, sm_90: at 4 windows no spills at 4 warps 2 stages / 8 warps; 24-56 B at 1 stage):
#  MK   gpu/mimo_kernels.py, dq and dk apart, windows 1 / 2 / 4 at 4 and 8 warps, 1 and 2 stages
#  MKT  the same with dq and dk in one launch (--dq-dk-together)
#  MP   the plugin's GPU tests in full on the committed defaults (dq, dk apart, the new grid)
#  MF   the shared launch's candidates against the reference at 16- and 32-token tiles (gpu/mimo_fault.py)
set -u
TOP=$OUT OUT=$OUT/r36 && mkdir -p "$OUT"  # only $TOP/r36.tgz (and the kernel cache, $TOP/kcache.tgz) come back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=25 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|tuned|first|block_t)|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
CONFIGS="4,2 4,1 8,1 8,2 4,1,2 4,2,2 8,1,2 8,2,2 4,1,4 4,2,4 8,1,4 8,2,4"
step 120 MK python gpu/mimo_kernels.py --bwd-configs $CONFIGS; show MK 60
step 120 MKT python gpu/mimo_kernels.py --dq-dk-together --bwd-configs $CONFIGS; show MKT 60
step 230 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 12
for c in "4 1 4" "8 1 2" "8 1 4" "4 2 4"; do
  for bt in 16 32; do
    set -- $c
    step 45 "MF_DQDK_$1_$2_$3_$bt" env CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py $1 $2 --pass DQDK --ns $3 \
      --block-t $bt; show "MF_DQDK_$1_$2_$3_$bt" 2
  done
done
tar -C "$TOP" -czf "$TOP/r36.tgz" r36 && rm -rf "$OUT"
OUT=$TOP kcache_pack
