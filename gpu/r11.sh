#!/usr/bin/env bash
# Round 11 (2026-11-28, fourth session), one H200, after `source gpu/host.sh`:
#  MC  the megatron engine at full size: the first save with its host buffers registered, one storage per shard
#      (round 10: 10.8 s, 8.8 of it Megatron's writer cloning views of one storage), then `--resume auto` from it
#      with the load's changes (gradient buffers released, optimizer load targets on the host, the state rebuilt
#      once; round 6: out of GPU memory at 130.9 GiB): resume to first step (target <= 60 s) and the load's peak
# Everything lands in $OUT/r11.tgz.
set -u
TOP=$OUT OUT=$OUT/r11 && mkdir -p "$OUT"  # only $TOP/r11.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-500} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
step 480 MC python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments \
  --set te.fp8=off --set train.recompute=mamba --steps 20 --every 20 --mbs 2 --work /tmp --keep \
  --json "$OUT/checkpoint_megatron_h200.json"
grep -E "^\||error|engine, MBS|buffers" "$OUT/MC.log" | tail -n 8 | tee -a "$OUT/$SUMMARY"
for f in /tmp/nam-checkpoint-*/async/run.log; do grep -v "Warning" "$f" | tail -n 40 > "$OUT/MC.run.log"; done
grep -E "checkpoint|resumed|memory" "$OUT/MC.run.log" | tee -a "$OUT/$SUMMARY"
for d in /tmp/nam-checkpoint-*/async; do cp "$d/metrics.jsonl" "$OUT/MC.metrics.jsonl"; startup "$d"; done
free -g | tee -a "$OUT/$SUMMARY"
rm -rf /tmp/nam-checkpoint-*
tar -C "$TOP" -czf "$TOP/r11.tgz" r11 && rm -rf "$OUT"
