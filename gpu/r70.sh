#!/usr/bin/env bash
# Round 70 (2026-12-07, nineteenth session; the H100 branch ran: FW below; the H200 branch NOT RUN, no H200 came),
# one GPU, after `source gpu/host.sh` with Transformer Engine taken along (.device-te, .te-cache: bash
# ../shared/device/fetch-te.sh, cp ../shared/device/te-cache/* .te-cache/) and the slim stack bundle
# (gpu/slim-site.sh: with TE and the tree the full one is over the 64 MiB a run takes along). Run: carry
# .device-wheels/site-slim.tar.xz, .device-wheels/install.sh, .device-te, .te-cache; command
# `mv .device-wheels/site-slim.tar.xz .device-wheels/site.tar.xz && export OUT && source gpu/host.sh &&
# BUDGET=530 bash gpu/r70.sh` (host setup ~47 s of the 600).
# Full NAM56R on the local engine at the recipe's settings (fp32-master, MBS 4, train.recompute=mamba-scan, the
# hopper-ce head), median of 3 steps after 1 warm-up:
#  L   TE none (the baseline) and TE FP8 current scaling (nam-plugin-te's linears), one process, two rows
#  G   TE none with compile_glue=true (the MoE gather-sum compiled) and mamba_split_in_proj=true (glue.md: the
#      two regions that gained alone, ~+14 and ~+6 ms a step by the table; end to end only measured together with
#      the losing regions, r2/r3)
#  GF  TE FP8 current with compile_glue=true (the split in_proj is refused where TE swapped in_proj)
# After L, the TileLang builds of the static b4 kernels (~150 s cold) are packed into $TOP/kcache.tgz for the next
# round.
# On a GPU under 120 GiB (an H100: the full model at MBS 4 does not fit) only FW runs (gpu/r69.sh's step).
# Result (H100, BUDGET=555): FW split pair 3.064 ms; one walk 8 warps 3.264, capped 128 6.557, 4 warps 3.003 (1.02x),
# 8 warps storing S_in 3.400; PS 2 at 4 warps faulted (illegal address), the rows after it not run.
set -u
TOP=$OUT OUT=$OUT/r70 && mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=60 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\| |rror|Traceback|OutOfMemory" "$OUT/$1.log" | head -n "${2:-30}" | tee -a "$OUT/$SUMMARY"; }
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
log "GPU $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${mem} MiB"
if (( mem < 120000 )); then
  step 330 FW python gpu/fwd_walk_probe.py time; show FW
else
  M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3 --engines local --recompute mamba-scan
     --te none,current)
  step 390 L "${M[@]}" --json "$OUT/local_mbs4_te_none_current.json"; show L
  tar -C "$TOP" -czf "$TOP/r70.tgz" r70  # what L measured comes back even if the call's time runs out below
  tar -C .kcache -cf - nam/tilelang nam/inductor | xz -3 -T0 > "$TOP/kcache.tgz"; ls -la "$TOP/kcache.tgz"
  step 110 G "${M[@]/none,current/none}" --train-set compile_glue=true --train-set mamba_split_in_proj=true \
    --json "$OUT/local_mbs4_te_none_glue_split.json"; show G
  step 110 GF "${M[@]/none,current/current}" --train-set compile_glue=true --json "$OUT/local_mbs4_te_current_glue.json"
  show GF
fi
tar -C "$TOP" -czf "$TOP/r70.tgz" r70 && rm -rf "$OUT"
