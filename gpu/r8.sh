#!/usr/bin/env bash
# Round 8 (2026-11-28, third session), one H200, after `source gpu/host.sh`:
#  CV  issue 31 item 3 again, with Transformer Engine's FusedAdam handled by the conversion (`bash gpu/convert.sh`)
#  MC  the megatron engine's async save at full size with the page-locked allocator setting (checks.PINNED_CONF):
#      its stall against round 6's 41.2 s, and its launch-to-first-step breakdown (warm); no resume (round 6: out of memory in Megatron's optimizer load at full size)
# Everything lands in $OUT/r8.tgz.
set -u
TOP=$OUT OUT=$OUT/r8 && mkdir -p "$OUT"  # only $TOP/r8.tgz and the kernel caches come back (8 files at most)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-400} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
mkdir -p "$OUT/convert"
step 180 CV env OUT="$OUT/convert" bash gpu/convert.sh
tail -n 12 "$OUT/CV.log" | tee -a "$OUT/$SUMMARY"
step 220 MC python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments \
  --set te.fp8=off --set train.recompute=mamba --steps 4 --every 4 --mbs 2 --work /tmp --no-resume --keep \
  --json "$OUT/checkpoint_megatron_h200.json"
grep -E "^\||error|engine, MBS" "$OUT/MC.log" | tail -n 6 | tee -a "$OUT/$SUMMARY"
for f in /tmp/nam-checkpoint-*/async/run.log; do grep -v "Warning" "$f" | tail -n 5 > "$OUT/MC.run.log"; done
for d in /tmp/nam-checkpoint-*/async; do startup "$d"; done  # the megatron engine's warm start (kernels cached)
rm -rf /tmp/nam-checkpoint-*
tar -C "$TOP" -czf "$TOP/r8.tgz" r8 && rm -rf "$OUT"
