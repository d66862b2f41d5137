"""Benchmark: one Mamba-3 layer at NAM56R's width on the mamba-ssm plugin vs mamba-ssm's own Mamba3 module.

Cases (d_model 4096, expand 2, d_state 128, 128 heads of 64, bf16, forward + backward of the whole layer:
in_proj, the scan, out_proj):

* ``mimo g8``   MIMO rank 4, chunk 16, ngroups 8: NAM56R's setting;
* ``mimo g1``   the same with one B/C group, the one MIMO setting upstream's backward runs;
* ``siso g8`` / ``siso g1``  rank 1, chunk 64 (upstream's recommended SISO chunk).

Columns:

* ``nam``        nam's ``Mamba3Mixer`` on ``MambaSSMScan`` with the patch lane applied;
* ``upstream``   ``mamba_ssm.modules.mamba3.Mamba3`` as released (only the import shim, without which it
                 does not import): measured first, before any patch; an exception is reported as the result;
* ``upstream+lane``  the same module after nam's patch lane: upstream's code on nam's MIMO drivers;
* ``nam+compile``  ``nam`` with ``mamba_compile_prelude=True`` (the elementwise region between in_proj and the
                 scan as one torch.compile graph); "compile ratio" = nam / nam+compile time.

Time: CUDA events around forward + backward, median of ``--iters`` after ``--warmup`` (upstream's per-call
host work shows up here, since the GPU waits for it); memory: peak allocated above the inputs. Prints one
markdown table with the speed-up over ``upstream`` and writes ``--json``.

    python bench/mamba3_layer.py --json bench/results/mamba3_layer.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import traceback
from pathlib import Path

import torch
from timing import time_and_peak

CASES = {"mimo g8": (4, 8, 16), "mimo g1": (4, 1, 16), "siso g8": (1, 8, 64), "siso g1": (1, 1, 64)}
"""name -> (rank, ngroups, chunk)."""


def measure(layer, x, dout, *, warmup: int, iters: int, baseline: bool = False) -> dict:
    """Median ms and peak GiB of forward + backward. Only a ``baseline`` row may fail and report its exception
    as its result; a failure of nam's own rows ends the run."""

    def clear():
        x.grad = None
        for p in layer.parameters():
            p.grad = None

    def step():
        clear()
        layer(x).backward(dout)

    if not baseline:
        ms, gib = time_and_peak(step, clear, warmup=warmup, iters=iters)
        return {"ms": ms, "peak_gib": gib}
    try:
        ms, gib = time_and_peak(step, clear, warmup=warmup, iters=iters)
    except Exception as e:  # the baseline's failure is its result (upstream's ngroups-8 backward raises)
        line = f"{type(e).__name__}: {e}".splitlines()[0]
        clear()
        return {"error": line[:200], "where": traceback.extract_tb(e.__traceback__)[-1].name}
    return {"ms": ms, "peak_gib": gib}


def forward_ms(layer, x, *, iters: int = 3) -> float:
    """Median forward-only milliseconds (no autograd), for a baseline whose backward fails."""
    times = []
    with torch.no_grad():
        layer(x)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            layer(x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def upstream_layer(rank: int, groups: int, chunk: int):
    from mamba_ssm.modules.mamba3 import Mamba3

    return Mamba3(d_model=4096, d_state=128, expand=2, headdim=64, ngroups=groups, rope_fraction=0.5,
                  is_mimo=rank > 1, mimo_rank=rank if rank > 1 else 4, chunk_size=chunk, device="cuda",
                  dtype=torch.bfloat16)


def nam_layer(rank: int, groups: int, chunk: int, compile_prelude: bool = False):
    from nam56r.blocks.mamba3 import Mamba3Mixer
    from nam56r.config import NAM56RConfig
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    cfg = NAM56RConfig(mamba_mimo_rank=rank, mamba_ngroups=groups, mamba_chunk=chunk, ssm_backend="mamba-ssm",
                       mamba_compile_prelude=compile_prelude)
    return Mamba3Mixer(cfg, MambaSSMScan()).to(device="cuda", dtype=torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--upstream-iters", type=int, default=3, help="iterations of the as-released baseline, "
                    "whose MIMO step takes over a second")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",")]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {list(CASES)}")

    from nam_plugin_mamba_ssm import patches, upstream

    upstream.install_shim()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(args.batch, args.seq, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    x.requires_grad_()
    dout = torch.randn(args.batch, args.seq, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
    results = {c: {} for c in cases}

    # 1. upstream as released, before any patch binds nam's drivers
    for case in cases:
        rank, groups, chunk = CASES[case]
        layer = upstream_layer(rank, groups, chunk)
        print(f"[upstream] {case} ...", flush=True)
        row = measure(layer, x, dout, warmup=1 if rank > 1 else args.warmup,
                      iters=args.upstream_iters if rank > 1 else args.iters, baseline=True)
        if "error" in row:
            row["forward_ms"] = forward_ms(layer, x)
        results[case]["upstream"] = row
        del layer
        torch.cuda.empty_cache()

    # 2. the patch lane, then nam's layer and upstream's module on nam's drivers
    applied = patches.apply_needed()
    print(f"patch lane applied: {applied}", flush=True)
    for case in cases:
        rank, groups, chunk = CASES[case]
        compiled = lambda r, g, c: nam_layer(r, g, c, compile_prelude=True)  # noqa: E731
        for column, make in (("nam", nam_layer), ("nam+compile", compiled), ("upstream+lane", upstream_layer)):
            if column == "upstream+lane" and rank == 1:
                continue  # the lane changes nothing on the SISO path
            layer = make(rank, groups, chunk)
            print(f"[{column}] {case} ...", flush=True)
            results[case][column] = measure(layer, x, dout, warmup=args.warmup, iters=args.iters)
            del layer
            torch.cuda.empty_cache()

    def cell(row):
        if row is None:
            return "-"
        if "error" in row:
            return f"raises {row['error'].split(':')[0]} (forward alone {row['forward_ms']:.1f} ms)"
        return f"{row['ms']:.2f} ms, {row['peak_gib']:.2f} GiB"

    print(f"\nMamba-3 layer fwd+bwd, b={args.batch} s={args.seq} d_model 4096, 128 heads of 64, d_state 128, bf16, "
          f"{torch.cuda.get_device_name()}\n")
    print("| case | nam (mamba-ssm plugin) | upstream Mamba3 as released | speed-up | nam + compiled prelude "
          "| compile ratio | upstream Mamba3 + nam lane |")
    print("|---|---|---|---|---|---|---|")
    for case in cases:
        r = results[case]
        ours, base = r.get("nam"), r.get("upstream")
        speed = (f"{base['ms'] / ours['ms']:.2f}x" if ours and "ms" in ours and base and "ms" in base
                 else "upstream fails" if base and "error" in base else "-")
        comp = r.get("nam+compile")
        ratio = f"{ours['ms'] / comp['ms']:.2f}x" if ours and comp and "ms" in ours and "ms" in comp else "-"
        print(f"| {case} | {cell(ours)} | {cell(base)} | {speed} | {cell(comp)} | {ratio} "
              f"| {cell(r.get('upstream+lane'))} |")

    if args.json:
        import importlib.metadata as md

        meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "versions": {d: md.version(d) for d in ("mamba-ssm", "tilelang", "triton")},
                "batch": args.batch, "seq": args.seq, "patches_applied": applied}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
