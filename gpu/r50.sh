#!/usr/bin/env bash
# Round 50, 2026-11-29 (seventh session), one H200, after `source gpu/host.sh`. r49: the phase inside the state walk
# made the walk 1.12 -> 1.56 ms (slower than walk + phase kernel: dropped), fwd_chunk looping over 2 / 4 chunks
# with 2 stages 5.0-5.5 ms against 2.22 (dropped); the phase kernel with cos.approx / sin.approx of the reduced
# phase: fwd+bwd 18.90 (r47: 18.98). Now the walks are offered PSPLIT 2 capped at 128 registers a thread (offline:
# state walk 324 B of spills, dstate walk 444 B), so that four programs fit an SM and the 512 programs of b2 run in
# one wave (uncapped, 242-246 registers: two an SM, two waves).
#  MK   gpu/mimo_kernels.py (per launch, now the phase kernel too; every config's tuner time)
#  MP   the plugin's GPU tests (with the cos / sin accuracy test)
# Result (ran at commit b639858): phase kernel 0.257 ms a call; the capped PSPLIT 2 walks 2.00 / 2.74 ms, dropped
# (7f45f29); the GPU tests 10 passed.
set -u
TOP=$OUT OUT=$OUT/r50 && mkdir -p "$OUT"  # only $TOP/r50.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-540} STEP_MIN=15 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^(ok|fwd|launch|first|digest|tuned (state_walk|dstate_walk))|passed|failed|FAILED|rror" \
  "$OUT/$1.log" | tail -n "${2:-12}" | tee -a "$OUT/$SUMMARY"; }
step 80 MK python gpu/mimo_kernels.py; show MK 20
step 420 MP python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -v -p no:cacheprovider
show MP 16
tar -C "$TOP" -czf "$TOP/r50.tgz" r50 && rm -rf "$OUT"
