#!/usr/bin/env bash
# Round 10 (2026-11-28, fourth session), one H200, after `source gpu/host.sh`:
#  MC  round 9 again with the host buffers registered (a shared mapping, pages touched, cudaHostRegister per shard)
#      in place of cudaHostAlloc, whose build stopped step 2 for 42.9 s. As round 9: the save after
#      the first step (checkpoint.HostShards; the allocator's register option gone): the first save's stall against
#      round 6's 41.2 s, its parts (state, copy, plan, fork), the build's time and what it cost the steps meanwhile.
#      20 steps before the save: the build of ~53 GB at ~1.6 GB/s needs ~35 s of steps. No resume (round 6: out
#      of GPU memory; the fix is not in yet)
# Everything lands in $OUT/r10.tgz.
set -u
TOP=$OUT OUT=$OUT/r10 && mkdir -p "$OUT"  # only $TOP/r10.tgz and the kernel caches come back (8 files at most)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-500} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
step 420 MC python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments \
  --set te.fp8=off --set train.recompute=mamba --steps 20 --every 20 --mbs 2 --work /tmp --no-resume --keep \
  --json "$OUT/checkpoint_megatron_h200.json"
grep -E "^\||error|engine, MBS|buffers" "$OUT/MC.log" | tail -n 8 | tee -a "$OUT/$SUMMARY"
for f in /tmp/nam-checkpoint-*/async/run.log; do grep -v "Warning" "$f" | tail -n 30 > "$OUT/MC.run.log"; done
for d in /tmp/nam-checkpoint-*/async; do cp "$d/metrics.jsonl" "$OUT/MC.metrics.jsonl"; startup "$d"; done
free -g | tee -a "$OUT/$SUMMARY"
rm -rf /tmp/nam-checkpoint-*
tar -C "$TOP" -czf "$TOP/r10.tgz" r10 && rm -rf "$OUT"
