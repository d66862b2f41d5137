#!/usr/bin/env bash
# Round 8 (2026-11-28, third session), one H200, after `source gpu/host.sh`:
#  CV  issue 31 item 3 again, with Transformer Engine's FusedAdam handled by the conversion (`bash gpu/convert.sh`)
#  MC  the megatron engine's async save at full size with the page-locked allocator setting (checks.PINNED_CONF):
#      its stall against round 6's 41.2 s, and its launch-to-first-step breakdown (warm); no resume
#  W4  the local engine's warm start (issue 31, <= 30 s), three runs on one machine: is round 5b's 36.4 s noise?
#  MF  issue 29: te.moe_fusion against the unfused path on nam56r-tiny (megatron engine, TE bf16, 6 steps, one
#      seed): fused, unfused, and unfused again (the run-to-run floor); each step's loss side by side (round 6: out of memory in Megatron's optimizer load at full size)
# Everything lands in $OUT/r8.tgz.
set -u
TOP=$OUT OUT=$OUT/r8 && mkdir -p "$OUT"  # only $TOP/r8.tgz and the kernel caches come back (8 files at most)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-565} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
mkdir -p "$OUT/convert"
TRAIN=(--recipe nam56r --set train.micro_batch_size=4 --set train.recompute=mamba-scan --set train.checkpoint_every=0)
for w in a b c; do
  step 70 W4$w nam train "${TRAIN[@]}" --max-steps 2 --run-dir /tmp/w4$w --json
  startup /tmp/w4$w
done
step 180 CV env OUT="$OUT/convert" bash gpu/convert.sh
tail -n 12 "$OUT/CV.log" | tee -a "$OUT/$SUMMARY"
step 220 MC python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments \
  --set te.fp8=off --set train.recompute=mamba --steps 4 --every 4 --mbs 2 --work /tmp --no-resume --keep \
  --json "$OUT/checkpoint_megatron_h200.json"
grep -E "^\||error|engine, MBS" "$OUT/MC.log" | tail -n 6 | tee -a "$OUT/$SUMMARY"
for f in /tmp/nam-checkpoint-*/async/run.log; do grep -v "Warning" "$f" | tail -n 5 > "$OUT/MC.run.log"; done
for d in /tmp/nam-checkpoint-*/async; do startup "$d"; done  # the megatron engine's warm start (kernels cached)
rm -rf /tmp/nam-checkpoint-*
TINY=(--recipe nam56r-tiny --engine megatron --nproc 1 --device cuda --plugins te --set te.fp8=off
      --set attention_backend=reference --set train.dtype=bfloat16 --set train.checkpoint_every=0 --seed 1234
      --max-steps 6 -q)
step 40 MF0 nam train "${TINY[@]}" --run-dir /tmp/mf0
step 40 MF1 nam train "${TINY[@]}" --set te.moe_fusion=true --run-dir /tmp/mf1
step 40 MF2 nam train "${TINY[@]}" --run-dir /tmp/mf2
python - <<'PY' | tee -a "$OUT/$SUMMARY"
import json
from pathlib import Path
runs = {"unfused": "/tmp/mf0", "moe_fusion": "/tmp/mf1", "unfused again": "/tmp/mf2"}
loss = {k: [json.loads(l).get("loss") for l in Path(d, "metrics.jsonl").read_text().splitlines()]
        if Path(d, "metrics.jsonl").is_file() else [] for k, d in runs.items()}
for k, v in loss.items():
    print(k, v)
PY
tar -C "$TOP" -czf "$TOP/r8.tgz" r8 && rm -rf "$OUT"
