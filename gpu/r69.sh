#!/usr/bin/env bash
# Round 69 (prepared 2026-12-07; its step ran as gpu/r70.sh's H100 branch, see there), one GPU, after
# `source gpu/host.sh`, with the kernel cache of r68 (.kcache/kcache.tgz taken along).
#  FW    gpu/fwd_walk_probe.py time: the forward as one walk per (b, h) at 8 warps (uncapped: one program an SM;
#        capped at 128 registers: two), at 4 warps, and with S_in stored, and split over 2 or 4 programs along the
#        head dim (PS), against state_walk + fwd_chunk at NAM56R's b2, bf16, CUDA events; the output's (and S_in's)
#        bits against the split forward's
# Build it into the plugin only if a row beats the split forward (and then with the GPU tests and the bench).
set -u
TOP=$OUT OUT=$OUT/r69 && mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-200} STEP_MIN=30 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\| |rror|Traceback" "$OUT/$1.log" | head -n "${2:-30}" | tee -a "$OUT/$SUMMARY"; }
step 180 FW python gpu/fwd_walk_probe.py time; show FW
tar -C "$TOP" -czf "$TOP/r69.tgz" r69 && rm -rf "$OUT"
