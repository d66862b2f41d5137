"""Benchmark: the hopper-ce head against Liger's fused linear CE (the liger head) at NAM56R's LM head.

Shape: 8192 tokens (one micro-batch of 2 x 4096) x hidden 4096 x vocab 131072, bf16, a 0/1 mask with 10% of
tokens masked; forward + backward of ``sum_t mask_t * CE_t / sum_t mask_t``, gradients of hidden and weight.
Rows: ``hopper-ce`` (nam_plugin_hopper_ce) with its gradients in the forward (three products; its peak counts the
dh and dW it holds from forward to backward) and in the backward (four; ``--configs`` adds backward rows at other
chunk and slice sizes), ``liger`` (nam_plugin_liger's head on the installed Liger: the baseline the ratios are
against), ``torch`` (F.linear to [t, v] logits + F.cross_entropy) and ``reference``
(nam's chunked fp32 head). Timing and peak memory as bench/liger.py (CUDA events, median of --iters; peak
allocated above the inputs). Prints one table and writes --json.

    python bench/hopper_ce.py --json bench/results/hopper_ce.json
    python bench/hopper_ce.py --tokens 16384 --warmup 2 --iters 5    # NAM56R at micro-batch 4
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from liger import make_inputs, measure, torch_baseline


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--configs", default="", help="extra hopper-ce backward-path rows, comma-separated CHUNK:SLICE "
                    "pairs (tokens per chunk : vocabulary rows per backward slice), e.g. 2048:65536")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)

    from nam56r.reference.ce import ReferenceCEHead
    from nam_plugin_hopper_ce.head import HopperCEHead
    from nam_plugin_liger.head import LigerCEHead

    heads = {"hopper-ce, gradients in forward": HopperCEHead(gradients="forward"),
             "hopper-ce, gradients in backward": HopperCEHead(gradients="backward")}
    for pair in filter(None, args.configs.split(",")):  # the vocabulary slice is the backward path's
        chunk, slice_ = (int(x) for x in pair.split(":"))
        heads[f"hopper-ce backward {chunk}:{slice_}"] = HopperCEHead(chunk_tokens=chunk, vocab_slice=slice_,
                                                                     gradients="backward")
    heads |= {"liger": LigerCEHead(), "torch": torch_baseline, "reference": ReferenceCEHead()}
    inputs = make_inputs(args.tokens, args.hidden, args.vocab)
    rows = {}
    for name, ce in heads.items():
        try:
            rows[name] = measure(ce, inputs, args.warmup, args.iters)
        except torch.OutOfMemoryError as e:
            rows[name] = {"error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}
            inputs[0].grad = inputs[1].grad = None
            torch.cuda.empty_cache()
    base = rows["liger"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens x hidden {args.hidden} x "
          f"vocab {args.vocab}, bf16, fwd+bwd, median of {args.iters}\n")
    print("| head | ms | speed-up vs liger | peak extra GiB | memory vs liger | loss |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | {r['error']} | | | | |")
            continue
        r["speedup_vs_liger"] = base["ms_median"] / r["ms_median"]
        r["memory_vs_liger"] = r["peak_extra_gib"] / base["peak_extra_gib"]
        print(f"| {name} | {r['ms_median']:.2f} | {r['speedup_vs_liger']:.2f}x | {r['peak_extra_gib']:.2f} | "
              f"{r['memory_vs_liger']:.2f}x | {r['loss']:.5f} |")
    if args.json_path:
        import importlib.metadata as md

        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "liger_kernel": md.version("liger-kernel"), "triton": md.version("triton"),
                "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab}}
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
