"""Time and memory of NAM56R's LM head + cross-entropy on one GPU: the liger head, the reference, plain torch.

At NAM56R's shape (8192 tokens of one micro-batch x hidden 4096 x vocab 131072, bf16) it measures forward +
backward of ``sum_t mask_t * CE_t / sum_t mask_t`` with a 0/1 mask (10% of tokens masked) for:

    liger       the ``liger`` head (nam_plugin_liger), the formulation chosen for the installed release
    reference   nam56r.reference.ce.ReferenceCEHead: chunked, fp32 math, gradients in forward
    torch       plain torch: F.linear to [t, v] bf16 logits, .float(), F.cross_entropy(ignore_index, "sum");
                what a model without a fused head does (the upstream baseline, ratios are against it)
    liger-sum   for the formulation choice only: Liger with the head's options but reduction="sum" and
                ignore_index on masked tokens, the one-logits-pass call the head does not use
                (nam_plugin_liger.head says why)

Time: CUDA events around forward + backward, ``--warmup`` calls first, the median of ``--iters``. Peak extra
memory: the allocator's peak during one forward + backward minus what was allocated before it (inputs and
weights), gradients of hidden and weight included for every variant. Nothing is asserted: numbers only.

    python bench/liger.py [--json PATH] [--tokens 8192 --hidden 4096 --vocab 131072]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

GiB = 1024**3
IGNORE_INDEX = -100


def torch_baseline(hidden, weight, target, mask):
    logits = F.linear(hidden, weight)  # [t, v] bf16: 2 GiB at NAM56R's shape, kept for backward
    target = torch.where(mask != 0, target, IGNORE_INDEX)
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="sum")  # fp32 [t, v]


def liger_sum_head():
    """Liger with the liger head's options (accum_dtype, chunk size) but reduction="sum" + ignore_index."""
    from nam_plugin_liger.head import liger_flce

    flce = liger_flce()

    def liger_sum(hidden, weight, target, mask):
        return flce(hidden, weight, torch.where(mask != 0, target, IGNORE_INDEX), "sum")

    return liger_sum


def variants() -> dict:
    """Name -> head callable. The liger head is what this bench is for: if it cannot be built here (Liger
    missing, or a #968 release without its patch), the NamError with its hint ends the run."""
    from nam56r.reference.ce import ReferenceCEHead
    from nam_plugin_liger.head import LigerCEHead

    head = LigerCEHead()
    head.formulation  # resolve now: a release with #968 and no patch raises here, not mid-timing
    return {"liger": head, "reference": ReferenceCEHead(), "torch": torch_baseline, "liger-sum": liger_sum_head()}


def make_inputs(t: int, d: int, v: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(t, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()  # [t, d]
    weight = (torch.randn(v, d, device="cuda", generator=g) * d**-0.5).bfloat16().requires_grad_()  # [v, d]
    target = torch.randint(0, v, (t,), device="cuda", generator=g)  # [t]
    mask = (torch.rand(t, device="cuda", generator=g) > 0.1).float()  # [t] 0/1, 10% masked
    return hidden, weight, target, mask


def step(ce, hidden, weight, target, mask) -> torch.Tensor:
    hidden.grad = weight.grad = None
    loss = ce(hidden, weight, target, mask) / mask.sum()
    loss.backward()
    return loss


def measure(ce, inputs, warmup: int, iters: int) -> dict:
    hidden, weight = inputs[0], inputs[1]
    for _ in range(warmup):
        step(ce, *inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(ce, *inputs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = step(ce, *inputs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    result = {"ms_median": statistics.median(times), "ms_min": min(times), "ms_all": times,
              "peak_extra_gib": peak / GiB, "loss": float(loss.detach())}
    hidden.grad = weight.grad = None
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 8192 x 4096 x 131072: one NAM56R micro-batch of 2 x 4096 tokens, hidden 4096, vocab 131072.
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--only", default="", help="comma-separated variants (default: all)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device\nhint: run it on the GPU host", file=sys.stderr)
        return 3

    inputs = make_inputs(args.tokens, args.hidden, args.vocab)
    wanted = [n for n in args.only.split(",") if n] or None
    heads = variants()
    rows: dict = {}
    for name, ce in heads.items():
        if wanted is not None and name not in wanted:
            continue
        try:
            rows[name] = measure(ce, inputs, args.warmup, args.iters)
        except torch.OutOfMemoryError as e:
            rows[name] = {"error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}
            inputs[0].grad = inputs[1].grad = None
            torch.cuda.empty_cache()

    base = rows.get("torch", {})
    for row in rows.values():
        if "error" not in row and "error" not in base and base:
            row["time_vs_torch"] = row["ms_median"] / base["ms_median"]
            row["memory_vs_torch"] = row["peak_extra_gib"] / base["peak_extra_gib"]

    import importlib.metadata

    liger_version = importlib.metadata.version("liger-kernel")  # installed: variants() built the head
    formulation = heads["liger"].formulation
    meta = {
        "shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": "bfloat16"},
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "liger_kernel": liger_version,
        "liger_formulation": formulation,
        "warmup": args.warmup, "iters": args.iters,
    }
    print(f"{meta['device']}, torch {meta['torch']}, liger-kernel {liger_version} ({formulation}); "
          f"{args.tokens} tokens x hidden "
          f"{args.hidden} x vocab {args.vocab}, bf16, forward + backward, median of {args.iters}")
    print(f"{'variant':<10} {'ms':>9} {'x torch':>8} {'peak extra GiB':>15} {'x torch':>8}  loss")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<10} {'-':>9} {'-':>8} {'-':>15} {'-':>8}  {row['error']}")
            continue
        t_ratio = f"{row['time_vs_torch']:.2f}" if "time_vs_torch" in row else "-"
        m_ratio = f"{row['memory_vs_torch']:.2f}" if "memory_vs_torch" in row else "-"
        print(f"{name:<10} {row['ms_median']:>9.2f} {t_ratio:>8} {row['peak_extra_gib']:>15.2f} {m_ratio:>8}  "
              f"{row['loss']:.5f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    from nam_core.errors import NamError

    try:
        sys.exit(main())
    except NamError as e:  # the liger head cannot run here: say why and how to fix it, exit non-zero
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
