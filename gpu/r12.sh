#!/usr/bin/env bash
# Round 12 (2026-11-28, fifth session), one H200, after `source gpu/host.sh`: where the megatron engine's resume
# at full size spends its time (round 11: 92.7 s launch to first step, 48.5 s of it the load; target <= 60 s).
#  MC  bench/checkpoint.py: a save at step 3 (53 GB), then `--resume auto` (no save of its own: the disk holds one
#      checkpoint) with the load under cProfile (gpu/hooks: NAM_PROFILE_LOAD) and its parts in run.log
#  RB  the same resume again, Megatron's files read one thread per file (gpu/hooks: NAM_PARALLEL_READ)
#  RC  as RB, the optimizer's load targets left on the GPU (gpu/hooks: NAM_TARGETS_ON_GPU; the state is still
#      released first): the conversions on the GPU instead of the host (its hook is gone: nam's default since,
#      checkpoint.targets_stay)
# Everything lands in $OUT/r12.tgz.
set -u
TOP=$OUT OUT=$OUT/r12 && mkdir -p "$OUT"  # only $TOP/r12.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
HOOKS=$PWD/gpu/hooks
ARGS=(--engine megatron --nproc 1 --plugins te --set te.fp8=off --set train.recompute=mamba
      --set train.micro_batch_size=2 --set train.async_checkpoints=true --set train.keep_checkpoints=1
      --set train.optimizer_numerics=bf16-moments --set train.checkpoint_every=0)
BASE=$PYTHONPATH
export NAM_PROFILE_LOAD=$OUT/load-MC PYTHONPATH=$HOOKS:$BASE
step 330 MC python bench/checkpoint.py --engine megatron --modes async --plugins te --numerics bf16-moments \
  --set te.fp8=off --set train.recompute=mamba --steps 3 --every 3 --mbs 2 --work /tmp --keep --no-save-after-resume \
  --json "$OUT/checkpoint_megatron_h200.json"
unset NAM_PROFILE_LOAD; export PYTHONPATH=$BASE
grep -E "^\||error|engine, MBS|buffers|by part" "$OUT/MC.log" | tail -n 8 | tee -a "$OUT/$SUMMARY"
RUN=$(ls -d /tmp/nam-checkpoint-*/async | head -1)
resume() {  # resume NAME VAR=VALUE...: --resume auto once more in the kept folder, to step 4
  local name=$1; shift
  env "$@" NAM_PROFILE_LOAD=$OUT/load-$name PYTHONPATH=$HOOKS:$BASE \
    timeout -k 5 "$(limit 150)" python -m nam_cli train --recipe nam56r "${ARGS[@]}" --max-steps 4 --run-dir "$RUN" \
    -q --resume auto > "$OUT/$name.log" 2>&1
  log "$name rc=$?"
  grep -E "resumed|hooks" "$OUT/$name.log" "$RUN/run.log" | tail -n 3 | tee -a "$OUT/$SUMMARY"
  startup "$RUN"
}
(( $(left) > 120 )) && resume RB NAM_PARALLEL_READ=1
(( $(left) > 120 )) && resume RC NAM_PARALLEL_READ=1 NAM_TARGETS_ON_GPU=1
grep -v "Warning" "$RUN/run.log" | tail -n 40 > "$OUT/run.log"
free -g | tee -a "$OUT/$SUMMARY"
rm -rf /tmp/nam-checkpoint-*
tar -C "$TOP" -czf "$TOP/r12.tgz" r12 && rm -rf "$OUT"
