#!/usr/bin/env bash
# Round 66, 2026-12-07 (tenth session), one H100 (no H200 came; the call took either), after `source gpu/host.sh`
# (no kernel cache: this session's checkout had none, so every build is cold).
#  MB    bench/mimo_scan.py, one run: mamba-ssm static, mimo-scan, mimo-scan-kept (keep_states=True: the backward
#        runs no state walk and no phase kernel), b2, with per-kernel profiles
#  MBR   the same under nam's activation checkpoint as the mixer runs train.recompute=mamba-scan (--recompute; the
#        replay through for_backward_only): mamba-ssm static against mimo-scan, which keeps its states there
#  MKK   gpu/mimo_kernels.py --keep-states: per-launch times and the digest (r55-r65, plain: 85d88b6746c5ee36),
#        the kept result against a plain call's in the same process, bit for bit
#  SS32  memcheck over mimo_fault.py: the shipped set at 32-token tiles (dq / dk at NS 2, 2 stages)
#  PH16  memcheck over mimo_fault.py: the per-head pass at 16 warps, 1 stage (a config the tuner times), 16-token
#        tiles
# Result (H100 80GB HBM3, ran BUDGET=440): MB static 16.11 ms fwd+bwd, mimo-scan 17.53 (0.92x), mimo-scan-kept 16.24
# (0.99x; the backward 14.02 -> 12.70), peak 4.49 GiB both (the backward holds the states either way); GPU time
# (profiles) 15.76 / 16.94 / 15.67 ms. MBR (--recompute): static 17.07, mimo-scan 18.66 (0.92x). MKK: digest
# 85d88b6746c5ee36 (the H200 rounds' r55-r65), kept bit-identical to a plain call; fwd+bwd 16.10. SS32 ok
# (1.49e-2), PH16 ok (1.33e-2), memcheck 0 errors in both.
set -u
TOP=$OUT OUT=$OUT/r66 && mkdir -p "$OUT"  # only $TOP/r66.tgz and $TOP/kcache.tgz come back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\| |digest|bit-identical|^fwd |^launch |rror|Traceback" "$OUT/$1.log" | head -n "${2:-30}" | tee -a "$OUT/$SUMMARY"; }
step 330 MB python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan mimo-scan-kept \
  --baseline mamba-ssm-static --warmup 2 --iters 5 --timeout 200 --profile "$OUT/prof" --json "$OUT/mimo_scan.json"; show MB
step 150 MBR python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 140 --recompute --json "$OUT/mimo_scan_recompute.json"; show MBR
step 120 MKK python gpu/mimo_kernels.py --keep-states; show MKK
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
mc=("$san" --tool memcheck --kernel-name kns=bwd_kernel --print-limit 4 python gpu/mimo_fault.py)
shown() { grep -E "^ok |ERROR SUMMARY|Out-of|Invalid|at bwd_kernel|rror" "$OUT/$1.log" | head -n 8 | tee -a "$OUT/$SUMMARY"; }
step 70 SS32 "${mc[@]}" 4 2 --pass DQ --ns 2 --block-t 32; shown SS32
step 70 PH16 "${mc[@]}" 16 1 --pass CHUNK --block-t 16; shown PH16
OUT=$TOP kcache_pack
tar -C "$TOP" -czf "$TOP/r66.tgz" r66 && rm -rf "$OUT"
