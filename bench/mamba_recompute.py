"""Benchmark and check: one Mamba-3 mixer at NAM56R's width on the mamba-ssm plugin under each recompute choice
that covers it (``train.recompute``: none, ``mamba``, ``mamba-scan``).

Per choice, forward + backward of the mixer on ``[batch, 4096, 4096]`` bf16 (the nam56r recipe's config,
mamba-ssm's MIMO kernels with the patch lane applied): CUDA-event time (median of ``--iters`` after
``--warmup``), the memory the forward keeps for backward (allocated after the forward minus before it, the
output included), the peak above the inputs, and the largest difference of the output, the input gradient
and every parameter gradient from the first ``none`` run. A second ``none`` run gives the floor: how far two
identical runs land apart on this GPU (0 where the kernels are deterministic). A recompute choice is bit-exact
when its differences are 0; the script exits 1 when one exceeds the floor.

    python bench/mamba_recompute.py --batch 4 --json bench/results/mamba_recompute.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
from timing import median_ms

MODES = ("none", "none again", "mamba", "mamba-scan")


def mixer(compile_prelude: bool):
    from nam56r.blocks.mamba3 import Mamba3Mixer
    from nam56r.recipes import get_recipe
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    cfg = get_recipe("nam56r").model.replace(ssm_backend="mamba-ssm", mamba_compile_prelude=compile_prelude)
    torch.manual_seed(0)
    return Mamba3Mixer(cfg, MambaSSMScan()).to(device="cuda", dtype=torch.bfloat16)


def runner(layer, mode: str):
    """``x -> y`` of ``layer`` under ``mode`` (as ``nam56r.model.Layer`` and ``nam56r.recompute.apply`` run it)."""
    from nam56r.recompute import checkpointed

    layer.recompute_scan = mode == "mamba-scan"
    if mode == "mamba":
        return lambda x: checkpointed(layer, None, x)
    return lambda x: layer(x, None)


def one(layer, mode: str, x, dout, *, warmup: int, iters: int) -> tuple[dict, dict]:
    """The row of ``mode`` and its output and gradients (for the comparison)."""
    run = runner(layer, mode)

    def clear():
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    def step():
        clear()
        run(x).backward(dout)

    ms = median_ms(step, warmup=warmup, iters=iters)
    clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = run(x)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - base
    y.backward(dout)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    values = {"output": y.detach().clone(), "input grad": x.grad.clone(),
              **{name: p.grad.clone() for name, p in layer.named_parameters()}}
    layer.recompute_scan = False
    return {"mode": mode, "ms": ms, "kept_gib": kept / 2**30, "peak_gib": peak / 2**30}, values


def largest_difference(a: dict, b: dict) -> tuple[float, str]:
    """The largest |a - b| over every tensor (inf where one is not finite) and the tensor it is in."""
    diffs = {}
    for name, t in a.items():
        d = (t.float() - b[name].float()).abs()
        diffs[name] = d.max().item() if torch.isfinite(d).all() else float("inf")
    where = max(diffs, key=diffs.get)
    return diffs[where], where


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--compile-prelude", action="store_true", help="the prelude under torch.compile, as the nam56r "
                    "recipe runs it (a compile at start); default eager: the recompute paths are the same")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from nam_plugin_mamba_ssm import patches

    applied = patches.apply_needed()
    layer = mixer(args.compile_prelude)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.batch, args.seq, 4096, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    dout = torch.randn(args.batch, args.seq, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    rows, reference = [], None
    for mode in MODES:
        row, values = one(layer, "none" if mode == "none again" else mode, x, dout, warmup=args.warmup,
                          iters=args.iters)
        row["mode"] = mode
        reference = reference or values
        row["max_abs_difference"], row["worst"] = largest_difference(values, reference)
        rows.append(row)
        print(f"[{mode}] {row['ms']:.2f} ms, kept {row['kept_gib']:.3f} GiB, difference "
              f"{row['max_abs_difference']:.3g}", flush=True)
    floor = rows[1]["max_abs_difference"]
    print(f"\nMamba-3 mixer fwd+bwd, b={args.batch} s={args.seq}, NAM56R width, bf16, {torch.cuda.get_device_name()}; "
          f"difference: largest |x - none| over the output, the input gradient and every parameter gradient\n")
    print("| recompute | ms | vs none | kept for backward GiB | peak above inputs GiB | difference from none "
          "| worst at |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['ms']:.2f} | {r['ms'] - rows[0]['ms']:+.2f} ms | {r['kept_gib']:.3f} "
              f"| {r['peak_gib']:.3f} | {r['max_abs_difference']:.3g} "
              f"| {r['worst'] if r['max_abs_difference'] else ''} |")
    bad = [r["mode"] for r in rows[2:] if r["max_abs_difference"] > floor]
    print(f"\nfloor (two runs without recompute): {floor:.3g}; " +
          (f"OVER THE FLOOR: {', '.join(bad)}" if bad else "every recompute choice within it"))
    if args.json:
        import importlib.metadata as md

        meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "versions": {d: md.version(d) for d in ("mamba-ssm", "tilelang")},
                "batch": args.batch, "seq": args.seq, "compile_prelude": args.compile_prelude,
                "patches_applied": applied}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "floor": floor}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
