#!/usr/bin/env bash
# Round 26 (2026-11-29), one H200, after `source gpu/host.sh`.
#  GS  bench/group_sums.py --sweep: the mamba-ssm MIMO backward's group + bias sums, eager against nam's one-read
#      Triton kernel (rewritten: the token sum kept per lane until the loop ends) at every tile of SWEEP
#  FE  issue 29's fp32-master row again (r25 FS: 10,083 tokens/s over 3 steps), 6 steps: megatron + TE bf16,
#      te.moe_fusion, bf16 gradient buffers, recompute mamba-scan,moe, MBS 4, the recipe's hopper-ce head
#  FF  the same with mamba-ssm.group_sums=fused (the kernel above at its committed TILE)
#  MT  nam-plugin-mimo-scan's GPU tests of this revision: no host sync, CUDA-graph capture (never run since the
#      harness makes the angles' expand inside the captured step), the first call's autotuning
#  GT  nam-plugin-mamba-ssm's GPU parity test of the group-sum forms (compiled, fused) at 128 heads in 8 groups
# Everything lands in $OUT/r26.tgz.
set -u
TOP=$OUT OUT=$OUT/r26 && mkdir -p "$OUT"  # only $TOP/r26.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-545} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(megatron|nam fused|eager)|fastest|passed|failed|FAILED|TrainingGuardError|OutOfMemory|Error" \
  "$OUT/$1.log" | tail -n "${2:-6}" | tee -a "$OUT/$SUMMARY"; }
step 120 GS python bench/group_sums.py --sweep --json "$OUT/group_sums_sweep.json"; show GS 40
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 6 --engines megatron --numerics fp32-master
   --te off --recompute mamba-scan,moe --train-set train.grad_reduce_in_fp32=false --train-set te.moe_fusion=true)
step 140 FE "${M[@]}" --json "$OUT/megatron_fp32master_eager_sums.json"; show FE 2
step 140 FF "${M[@]}" --train-set mamba-ssm.group_sums=fused --json "$OUT/megatron_fp32master_fused_sums.json"; show FF 2
step 100 MT python -m pytest -m gpu plugins/nam-plugin-mimo-scan/tests/test_mimo_scan_gpu.py -q -p no:cacheprovider \
  -k "host_sync or capture or first_call"; show MT 8
step 60 GT python -m pytest -m gpu plugins/nam-plugin-mamba-ssm/tests/test_mamba_ssm_gpu.py -q -p no:cacheprovider \
  -k "each_form_of_the_group_sums"; show GT 6
tar -C "$TOP" -czf "$TOP/r26.tgz" r26 && rm -rf "$OUT"
