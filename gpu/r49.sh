#!/usr/bin/env bash
# Round 49, 2026-11-29 (seventh session), one H200, after `source gpu/host.sh`. r47's profile: the phase kernel
# 2 x 0.38 ms a step (one walk of the sequence per (b, h) before each pass), offline 77% of its SASS libdevice's
# cos / sin. Now (a) the state walk, the first kernel of each pass, takes the phase and the tiles' log-decay cumsums
# along (`NAM_MIMO_PHASE=walk`, the default here) and writes the table the later kernels read: no phase kernel;
# (b) cos / sin of the reduced phase are cos.approx / sin.approx (`kernels._cos_sin_mod`, both variants);
# (c) fwd_chunk is offered CPB 2 and 4 chunks a program (a loop, 2 stages) beside the one-chunk program.
#  MKW   gpu/mimo_kernels.py, the phase in the walk (per launch, fwd+bwd, every config's tuner time)
#  MKK   the same with the phase kernel (`NAM_MIMO_PHASE=kernel`), fwd_chunk one chunk a program
#  PROF  bench/mimo_scan.py --profile, nam's row only (the walk variant)
#  MP    the plugin's GPU tests (the walk variant; the new cos / sin accuracy test)
# Result (ran at commit 18d3463): the walk with the phase 1.56 ms against 1.12 + the phase kernel, fwd_chunk at 2 / 4
# chunks 5.49 / 4.98 ms: both dropped (b639858); the phase kernel's cos.approx / sin.approx kept. The GPU tests ran
# past the step's 240 s (9 of 10 had passed).
set -u
TOP=$OUT OUT=$OUT/r49 && mkdir -p "$OUT"  # only $TOP/r49.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-560} STEP_MIN=15 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*mimo-scan|^(ok|fwd|launch|first|digest|tuned (state_walk|fwd_chunk))|_kernel |passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 90 MKW python gpu/mimo_kernels.py; show MKW 22
step 70 MKK env NAM_MIMO_PHASE=kernel python gpu/mimo_kernels.py --chunk-configs 4,1; show MKK 14
step 45 PROF python bench/mimo_scan.py --batch 2 --rows mimo-scan --baseline mimo-scan --warmup 2 --iters 5 \
  --timeout 40 --profile "$OUT/prof"; show PROF 3; grep -h "_kernel " "$OUT"/prof/*.txt | cut -c1-60,140-200 \
  | tee -a "$OUT/$SUMMARY"
step 240 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 16
tar -C "$TOP" -czf "$TOP/r49.tgz" r49 && rm -rf "$OUT"
