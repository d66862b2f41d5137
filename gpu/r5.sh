#!/usr/bin/env bash
# Round 5 (2026-11-28, third session), call 1 of 2 on one H200, after `source gpu/host.sh` with the kernel
# caches of earlier rounds (MBS 4 and MBS 2 kernels; no inductor cache yet: it joins nam's cache folder now):
#  W1  warm start, `nam train --recipe nam56r` MBS 4 mamba-scan, 2 steps (inductor builds the compiled prelude)
#  W2  the same again, every cache warm: issue 31's warm launch-to-first-step (summary.json startup_s and
#      self_tests_s say where it goes)
#  WP  W2's run under cProfile, 1 step: what inside the self-tests takes the time (WP.txt, cumulative)
#  CP  cold `nam preflight --recipe nam56r` (the recipe's MBS 1): every compile cache empty (a fresh
#      NAM_CACHE_DIR holds TileLang's, Triton's and inductor's), issue 31's <= 180 s
# Everything lands in $OUT/r5.tgz.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
R=/tmp/r5 && mkdir -p $R
TRAIN=(--recipe nam56r --set train.micro_batch_size=4 --set train.recompute=mamba-scan --set train.checkpoint_every=0)
step 100 W1 nam train "${TRAIN[@]}" --max-steps 2 --run-dir $R/w1 --json
startup $R/w1
step 80 W2 nam train "${TRAIN[@]}" --max-steps 2 --run-dir $R/w2 --json
startup $R/w2
step 90 WP python -m cProfile -o "$OUT/wp.prof" -m nam_cli train "${TRAIN[@]}" --max-steps 1 --run-dir $R/wp --json
startup $R/wp
python -c 'import pstats,sys; p=pstats.Stats(sys.argv[1]); p.sort_stats("cumulative").print_stats(120); p.sort_stats("tottime").print_stats(40)' "$OUT/wp.prof" > "$OUT/WP.txt" 2>&1
du -sh .kcache/nam/* | tee -a "$OUT/$SUMMARY"
step 250 CP env NAM_CACHE_DIR=/tmp/cold-cache nam preflight --recipe nam56r --json
tail -c 3000 "$OUT/CP.log" > "$OUT/CP.tail.txt"
du -sh /tmp/cold-cache/* | tee -a "$OUT/$SUMMARY"
cp $R/w2/run.log "$OUT/W2.run.log" 2>/dev/null
tar -C "$OUT" -czf "$OUT/r5.tgz" $(cd "$OUT" && ls | grep -v -e '\.tgz$')
