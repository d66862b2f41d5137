#!/usr/bin/env bash
# Round 16 (2026-11-28, sixth session), one H200, after `source gpu/host.sh`: issue 31's warm start (<= 30 s from
# launch to the end of the first step) with mamba-ssm's package import deferred (patch mamba-ssm-package-import)
# and the megatron engine's `--nproc 1` in the command's own process.
#  IM  the patch on the real mamba-ssm: the lane applied, Mamba-3's MIMO module imported; what got imported, how
#      long it took, and the patch's reproducer (a fresh interpreter without and with the deferral)
#  W5  the local engine's warm start, round 8's W4 command (MBS 4), three runs: 30.8, 24.9, 23.4 s there
#  MW  the megatron engine's warm start (round 15's resume flags, no checkpoint), two runs
# Everything lands in $OUT/r16.tgz.
set -u
TOP=$OUT OUT=$OUT/r16 && mkdir -p "$OUT"  # only $TOP/r16.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
step 60 IM python gpu/lazy_import.py
tail -n 6 "$OUT/IM.log" | tee -a "$OUT/$SUMMARY"
TRAIN=(--recipe nam56r --set train.micro_batch_size=4 --set train.recompute=mamba-scan --set train.checkpoint_every=0)
for w in a b c; do
  step 120 W5$w nam train "${TRAIN[@]}" --max-steps 2 --run-dir /tmp/w5$w --json
  startup /tmp/w5$w
done
MEG=(--recipe nam56r --engine megatron --nproc 1 --plugins te --set te.fp8=off --set train.recompute=mamba
     --set train.micro_batch_size=2 --set train.optimizer_numerics=bf16-moments --set train.checkpoint_every=0)
for w in a b; do
  step 110 MW$w nam train "${MEG[@]}" --max-steps 2 --run-dir /tmp/mw$w --json
  startup /tmp/mw$w
done
rm -rf /tmp/w5? /tmp/mw?
tar -C "$TOP" -czf "$TOP/r16.tgz" r16 && rm -rf "$OUT"
