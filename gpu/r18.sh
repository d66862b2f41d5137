#!/usr/bin/env bash
# Round 18 (2026-11-28, sixth session), one H200, after `source gpu/host.sh`: issue 31's warm start with both import
# patches (mamba-ssm-package-import; liger-peft-probe-import: round 17 found liger_kernel.utils importing peft,
# which imports transformers and scikit-learn, 15.3 s under importtime).
#  IM  both patches on the real packages (gpu/lazy_import.py)
#  W6  the local engine's warm start, round 8's W4 and round 16's W5 command (MBS 4), three runs
#  MW  the megatron engine's warm start (round 16's MW command), two runs
# Everything lands in $OUT/r18.tgz.
set -u
TOP=$OUT OUT=$OUT/r18 && mkdir -p "$OUT"  # only $TOP/r18.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-480} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
step 90 IM python gpu/lazy_import.py
grep -v Composable "$OUT/IM.log" | tail -n 12 | tee -a "$OUT/$SUMMARY"
TRAIN=(--recipe nam56r --set train.micro_batch_size=4 --set train.recompute=mamba-scan --set train.checkpoint_every=0)
for w in a b c; do
  step 100 W6$w nam train "${TRAIN[@]}" --max-steps 2 --run-dir /tmp/w6$w --json
  startup /tmp/w6$w
done
MEG=(--recipe nam56r --engine megatron --nproc 1 --plugins te --set te.fp8=off --set train.recompute=mamba
     --set train.micro_batch_size=2 --set train.optimizer_numerics=bf16-moments --set train.checkpoint_every=0)
for w in a b; do
  step 100 MW$w nam train "${MEG[@]}" --max-steps 2 --run-dir /tmp/mw$w --json
  startup /tmp/mw$w
done
rm -rf /tmp/w6? /tmp/mw?
tar -C "$TOP" -czf "$TOP/r18.tgz" r18 && rm -rf "$OUT"
