#!/usr/bin/env bash
# Round 27 (2026-11-29), one H200, after `source gpu/host.sh`. The group sums' kernel at its swept tile
# (group_sums.TILE = (512, 8, 4, 1), now the mamba-ssm scan's default form) in the full model, against eager in the
# same round; issue 29's fp32-master row (megatron + TE bf16, te.moe_fusion, bf16 gradient buffers, recompute
# mamba-scan,moe, MBS 4, hopper-ce head), 6 steps each:
#  FE  mamba-ssm.group_sums=eager
#  FF  the default (fused), profiled (the shapes table now 80 rows: what the copies and elementwise kernels are)
#  MS  bench/mimo_scan.py: mamba-ssm's static kernels and nam's mimo-scan in one run (b2 x 4096)
#  GT  nam-plugin-mamba-ssm's GPU parity test of the group-sum forms (r26 ran out of its 60 s building kernels)
set -u
TOP=$OUT OUT=$OUT/r27 && mkdir -p "$OUT"  # only $TOP/r27.tgz comes back
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
BUDGET=${BUDGET:-500} STEP_MIN=20 STEP_EXT=.log SUMMARY=summary.txt
show() { grep -E "^\|.*(megatron|mamba-ssm|mimo-scan)|GPU busy|passed|failed|FAILED|TrainingGuardError|OutOfMemory|Error" \
  "$OUT/$1.log" | tail -n "${2:-6}" | tee -a "$OUT/$SUMMARY"; }
M=(python bench/megatron.py throughput --gpus 1 --mbs 4 --warmup 1 --iters 6 --engines megatron --numerics fp32-master
   --te off --recompute mamba-scan,moe --train-set train.grad_reduce_in_fp32=false --train-set te.moe_fusion=true)
step 100 FE "${M[@]}" --train-set mamba-ssm.group_sums=eager --json "$OUT/megatron_fp32master_eager_sums.json"; show FE 2
step 110 FF "${M[@]}" --profile "$OUT/prof" --json "$OUT/megatron_fp32master_fused_sums.json"; show FF 2
step 110 MS python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static \
  --warmup 2 --iters 5 --timeout 100 --json "$OUT/mimo_scan_vs_static.json"; show MS 6
step 150 GT python -m pytest -m gpu plugins/nam-plugin-mamba-ssm/tests/test_mamba_ssm_gpu.py -q -p no:cacheprovider \
  -k "each_form_of_the_group_sums"; show GT 6
tar -C "$TOP" -czf "$TOP/r27.tgz" r27 && rm -rf "$OUT"
