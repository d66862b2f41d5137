#!/usr/bin/env bash
# Round 66, 2026-12-07 (tenth session), one H200, after `source gpu/host.sh` (no kernel cache: this session's
# checkout had none, so every build is cold).
#  MB    bench/mimo_scan.py, one run: mamba-ssm static, mimo-scan, mimo-scan-kept (keep_states=True: the backward
#        runs no state walk and no phase kernel), b2, with per-kernel profiles
#  MBR   the same under nam's activation checkpoint as the mixer runs train.recompute=mamba-scan (--recompute; the
#        replay through for_backward_only): mamba-ssm static against mimo-scan, which keeps its states there
#  MK0   gpu/mimo_kernels.py: per-launch times and the digest (r55-r65: 85d88b6746c5ee36)
#  MKK   the same with --keep-states: the digest must not change
# Result: (filled in after the round)
set -u
TOP=$OUT OUT=$OUT/r66 && mkdir -p "$OUT"  # only $TOP/r66.tgz and $TOP/kcache.tgz come back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\| |digest|^fwd |^launch |rror|Traceback" "$OUT/$1.log" | head -n "${2:-30}" | tee -a "$OUT/$SUMMARY"; }
step 300 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan mimo-scan-kept \
  --baseline mamba-ssm-static --profile "$OUT/prof" --json "$OUT/mimo_scan.json"; show MB
step 200 MBR python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --recompute --json "$OUT/mimo_scan_recompute.json"; show MBR
step 150 MK0 python gpu/mimo_kernels.py; show MK0
step 80 MKK python gpu/mimo_kernels.py --keep-states; show MKK
OUT=$TOP kcache_pack
tar -C "$TOP" -czf "$TOP/r66.tgz" r66 && rm -rf "$OUT"
