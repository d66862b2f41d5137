#!/usr/bin/env bash
# Round 22 (2026-11-28, seventh session), one H200, after `source gpu/host.sh`. The CE heads in three products:
# nam-plugin-hopper-ce's `gradients=forward` (dh and dW computed in the forward, scaled by the upstream gradient
# in backward) against the heads the engines run now (liger: four products, its per-token upstream gradient
# folded into the logits gradient; hopper-ce's default: four products). r21's profile put the heads at ~334 ms of
# the megatron step's 1,683 (the liger logits recomputed in backward ~70 ms, its per-token multiply 18 ms).
#  T   the plugin's GPU tests (parity of both paths at NAM56R's head width, the preflight row, the peak)
#  H   bench/hopper_ce.py at 16384 tokens (micro-batch 4): liger, hopper-ce, hopper-ce gradients=forward, torch
#  MH  megatron, TE bf16, te.moe_fusion, bf16-moments, mamba-scan, MBS 4 (r21's MS row: 9,774) with the
#      hopper-ce head, gradients=forward
#  LH  local, fp32-master, mamba-scan, MBS 4 (r21's LS row: 9,703), the same head
#  MB  MH with hopper-ce's default path (gradients=backward): what the head alone changes against liger
# Everything lands in $OUT/r22.tgz.
set -u
TOP=$OUT OUT=$OUT/r22 && mkdir -p "$OUT"  # only $TOP/r22.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-550} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(local|megatron|hopper|liger|torch)|passed|failed|GPU busy|TrainingGuardError|OutOfMemory|Error" "$OUT/$1.log" | tail -n 8 | tee -a "$OUT/$SUMMARY"; }
step 90 T python -m pytest -m gpu plugins/nam-plugin-hopper-ce -q -s -p no:cacheprovider; show T
step 90 H python bench/hopper_ce.py --tokens 16384 --warmup 2 --iters 5 --json "$OUT/hopper_ce_16384.json"; show H
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 3 --recompute mamba-scan --ce hopper-ce)
MEG=(--engines megatron --numerics bf16-moments --te off --train-set te.moe_fusion=true)
step 150 MH "${M[@]}" "${MEG[@]}" --train-set hopper-ce.gradients=forward --json "$OUT/megatron_hopper_ce_forward.json"; show MH
step 120 LH "${M[@]}" --engines local --te none --train-set hopper-ce.gradients=forward --json "$OUT/local_hopper_ce_forward.json"; show LH
step 150 MB "${M[@]}" "${MEG[@]}" --json "$OUT/megatron_hopper_ce_backward.json"; show MB
tar -C "$TOP" -czf "$TOP/r22.tgz" r22 && rm -rf "$OUT"
