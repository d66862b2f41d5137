#!/usr/bin/env bash
# Round 17 (2026-11-28, sixth session), one H200, after `source gpu/host.sh`: where a warm start's self-tests go now
# that mamba-ssm's package import is deferred (round 16: the mamba-ssm launch check fell by 4-7 s and liger's rose
# from 1.6-5.5 to 11.1-12.2 s, a cost that moved rather than went).
#  WP  round 16's W5 command once under `python -X importtime` (every module's import, self and cumulative us) with
#      the activation under cProfile (gpu/hooks: NAM_PROFILE_ACTIVATE)
# Everything lands in $OUT/r17.tgz.
set -u
TOP=$OUT OUT=$OUT/r17 && mkdir -p "$OUT"  # only $TOP/r17.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-200} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
TRAIN=(--recipe nam56r --set train.micro_batch_size=4 --set train.recompute=mamba-scan --set train.checkpoint_every=0)
step 150 WP env PYTHONPATH="$PWD/gpu/hooks:$PYTHONPATH" NAM_PROFILE_ACTIVATE="$OUT/activate" \
  python -X importtime -m nam_cli train "${TRAIN[@]}" --max-steps 2 --run-dir /tmp/wp --json
startup /tmp/wp
grep "import time:" "$OUT/WP.log" > "$OUT/importtime.txt"; grep -v "import time:" "$OUT/WP.log" > "$OUT/WP.out"
rm -f "$OUT/WP.log" "$OUT/activate.prof"
sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -n 60 > "$OUT/importtime-top.txt"
rm -rf /tmp/wp
tar -C "$TOP" -czf "$TOP/r17.tgz" r17 && rm -rf "$OUT"
