#!/usr/bin/env bash
# Round 6 (2026-11-28, third session), call 2 of 2 on the same warm H200:
#  CV  issue 31 item 3: `bash gpu/convert.sh` (nam56r-tiny continued by the other engine, both ways)
#  MC  issue 31 item 1, the megatron engine: `bench/checkpoint.py --engine megatron` at full size, MBS 2,
#      bf16-moments (TE's FusedAdam; the smallest checkpoint the megatron engine writes: 47 GB), one async save
#      and the resume to the first step after it
# Everything lands in $OUT/r6.tgz.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-570} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
mkdir -p "$OUT/convert"
step 200 CV env OUT="$OUT/convert" bash gpu/convert.sh
tail -n 12 "$OUT/CV.log"
df -h /tmp | tail -n 1 | tee -a "$OUT/$SUMMARY"
step 360 MC python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments \
  --set te.fp8=off --set train.recompute=mamba --steps 4 --every 4 --mbs 2 --work /tmp --keep \
  --json "$OUT/checkpoint_megatron_h200.json"
tail -n 8 "$OUT/MC.log"
for f in /tmp/nam-checkpoint-*/async/run.log; do cp "$f" "$OUT/MC.run.log"; done
du -sh /tmp/nam-checkpoint-*/async/checkpoints/* 2>/dev/null | tee -a "$OUT/$SUMMARY"
rm -rf /tmp/nam-checkpoint-*
tar -C "$OUT" -czf "$OUT/r6.tgz" $(cd "$OUT" && ls | grep -v -e '\.tgz$')
