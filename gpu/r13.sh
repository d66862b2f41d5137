#!/usr/bin/env bash
# Round 13 (2026-11-28, fifth session), one H200, after `source gpu/host.sh`: the megatron engine's resume at full
# size with this session's changes in nam (files read side by side, the optimizer's load targets kept on the GPU
# when the rebuild fits, the checkpoint verified on a background thread beside the self-tests); target <= 60 s.
#  MC  bench/checkpoint.py: a save at step 3 (53 GB), then `--resume auto` without a save of its own
#  RB  the same resume once more (the spread between two runs)
#  LR  the local engine's saves with its host buffers registered (`--host-buffers register`, never run before)
#      against round 4's `alloc` (~10.4 s of training lost once per process while they were built)
# Everything lands in $OUT/r13.tgz.
set -u
TOP=$OUT OUT=$OUT/r13 && mkdir -p "$OUT"  # only $TOP/r13.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-550} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
ARGS=(--engine megatron --nproc 1 --plugins te --set te.fp8=off --set train.recompute=mamba
      --set train.micro_batch_size=2 --set train.async_checkpoints=true --set train.keep_checkpoints=1
      --set train.optimizer_numerics=bf16-moments --set train.checkpoint_every=0)
step 330 MC python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments \
  --set te.fp8=off --set train.recompute=mamba --steps 3 --every 3 --mbs 2 --work /tmp --keep --no-save-after-resume \
  --json "$OUT/checkpoint_megatron_h200.json"
grep -E "^\||error|engine, MBS|buffers|by part" "$OUT/MC.log" | tail -n 8 | tee -a "$OUT/$SUMMARY"
RUN=$(ls -d /tmp/nam-checkpoint-*/async | head -1)
if (( $(left) > 100 )); then
  timeout -k 5 "$(limit 120)" python -m nam_cli train --recipe nam56r "${ARGS[@]}" --max-steps 4 --run-dir "$RUN" \
    -q --resume auto > "$OUT/RB.log" 2>&1
  log "RB rc=$?"
  startup "$RUN"
fi
grep -E "resumed|load targets|checkpoint check" "$RUN/run.log" | tail -n 6 | tee -a "$OUT/$SUMMARY"
grep -v "Warning" "$RUN/run.log" | tail -n 40 > "$OUT/run.log"
rm -rf /tmp/nam-checkpoint-*
step 200 LR python bench/checkpoint.py --steps 30 --every 30 --mbs 2 --modes async --numerics bf16 --host-buffers register \
  --no-save-after-resume --work /tmp --json "$OUT/checkpoint_local_register_h200.json"
grep -E "^\||error|engine, MBS|buffers|by part" "$OUT/LR.log" | tail -n 8 | tee -a "$OUT/$SUMMARY"
rm -rf /tmp/nam-checkpoint-*
tar -C "$TOP" -czf "$TOP/r13.tgz" r13 && rm -rf "$OUT"
