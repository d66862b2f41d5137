#!/usr/bin/env bash
# Round 15 (2026-11-28, sixth session), one H200, after `source gpu/host.sh`: the megatron engine's resume at full
# size with `--nproc 1` training in the command's own process (no torchrun exec: parallel.one_rank_env); target
# <= 60 s, round 13 measured 62.5 and 64.7 s with resolve 8.1 and 9.4 s of it.
#  MC  bench/checkpoint.py: a save at step 3 (53 GB), then `--resume auto` without a save of its own
#  RP  the same resume again with the plugins' activation (the `self-tests` phase) under cProfile
#      (gpu/hooks: NAM_PROFILE_ACTIVATE), for where its 33-36 s go
#  RC  the same resume once more, not profiled (the spread between runs)
# Everything lands in $OUT/r15.tgz.
set -u
TOP=$OUT OUT=$OUT/r15 && mkdir -p "$OUT"  # only $TOP/r15.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-545} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
ARGS=(--engine megatron --nproc 1 --plugins te --set te.fp8=off --set train.recompute=mamba
      --set train.micro_batch_size=2 --set train.async_checkpoints=true --set train.keep_checkpoints=1
      --set train.optimizer_numerics=bf16-moments --set train.checkpoint_every=0)
step 330 MC python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments \
  --set te.fp8=off --set train.recompute=mamba --steps 3 --every 3 --mbs 2 --work /tmp --keep --no-save-after-resume \
  --json "$OUT/checkpoint_megatron_h200.json"
grep -E "^\||error|engine, MBS|buffers|by part" "$OUT/MC.log" | tail -n 8 | tee -a "$OUT/$SUMMARY"
RUN=$(ls -d /tmp/nam-checkpoint-*/async | head -1)
resume() {  # resume NAME [ENV...]: the same resume once more, its start-up's parts after it
  local name=$1; shift
  if (( $(left) > 90 )); then
    log "$name"
    env "$@" timeout -k 5 "$(limit 120)" python -m nam_cli train --recipe nam56r "${ARGS[@]}" --max-steps 4 \
      --run-dir "$RUN" -q --resume auto > "$OUT/$name.log" 2>&1
    log "$name rc=$?"
    startup "$RUN"
  else
    log "$name: skipped, out of time"
  fi
}
resume RP PYTHONPATH="$PWD/gpu/hooks:$PYTHONPATH" NAM_PROFILE_ACTIVATE="$OUT/activate"
resume RC
grep -E "resumed|load targets|checkpoint check" "$RUN/run.log" | tail -n 9 | tee -a "$OUT/$SUMMARY"
grep -v "Warning" "$RUN/run.log" | tail -n 40 > "$OUT/run.log"
rm -rf /tmp/nam-checkpoint-*
tar -C "$TOP" -czf "$TOP/r15.tgz" r15 && rm -rf "$OUT"
