#!/usr/bin/env bash
# Round 19 (2026-11-28, sixth session), one H200, after `source gpu/host.sh`: the first warm start on a fresh host
# with the bundle's bytecode compiled first, as `pip install` does on a user's machine (gpu/host.sh unpacks /tmp/site
# without .pyc files, so a round's first process compiles every module it imports: round 18's first runs took
# 31.9 and 31.8 s against 24.3/23.8 and 27.3 s after).
#  PC  python -m compileall over /tmp/site (not part of any start)
#  W7a round 18's W6 command (local engine, MBS 4); MWa round 18's MW command (megatron engine); W7b W7a again
# Everything lands in $OUT/r19.tgz.
set -u
TOP=$OUT OUT=$OUT/r19 && mkdir -p "$OUT"  # only $TOP/r19.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-275} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
step 90 PC python -m compileall -q -j 0 /tmp/site
TRAIN=(--recipe nam56r --set train.micro_batch_size=4 --set train.recompute=mamba-scan --set train.checkpoint_every=0)
step 70 W7a nam train "${TRAIN[@]}" --max-steps 2 --run-dir /tmp/w7a --json
startup /tmp/w7a
MEG=(--recipe nam56r --engine megatron --nproc 1 --plugins te --set te.fp8=off --set train.recompute=mamba
     --set train.micro_batch_size=2 --set train.optimizer_numerics=bf16-moments --set train.checkpoint_every=0)
step 70 MWa nam train "${MEG[@]}" --max-steps 2 --run-dir /tmp/mwa --json
startup /tmp/mwa
step 60 W7b nam train "${TRAIN[@]}" --max-steps 2 --run-dir /tmp/w7b --json
startup /tmp/w7b
rm -rf /tmp/w7? /tmp/mwa
tar -C "$TOP" -czf "$TOP/r19.tgz" r19 && rm -rf "$OUT"
