"""Benchmark: the pipelining depth of mamba-ssm's three MIMO kernels at NAM56R's shape.

The kernels (forward, backward pass 1 ``bwd_fwd``, backward pass 2 ``bwd_bwd``) each walk the sequence's
chunks in one loop; TileLang's ``num_stages`` sets how many chunks' loads that loop keeps in flight. Upstream's
drivers launch all three at 0, and so does nam (``nam_plugin_mamba_ssm.mimo.STAGES``). This benchmark builds
other depths and measures, per variant, at sequence 4096, 128 heads of 64, 8 groups, d_state 128, rank 4,
chunk 16, bf16:

* each kernel's median time (CUDA events around the launch, inside a full scan forward + backward);
* the whole scan's forward + backward (the kernels plus mamba-ssm's Triton pre- and post-passes);
* the largest difference of the output and of every input gradient from the ``0,0,0`` variant, relative to
  the largest magnitude of that tensor (0 means bit-identical).

Every variant runs in its own process under ``--timeout``: a depth TileLang cannot build (shared memory) or a
kernel that hangs is that row's result, not the end of the run. The ``0,0,0`` variant runs first: it is
the baseline of the ratios and of the differences.

    python bench/mimo_stages.py --variants 0,0,0 1,0,0 2,0,0 0,1,0 0,0,1 --batch 1,2 --json PATH
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = {"l": 4096, "h": 128, "g": 8, "n": 128, "p": 64, "r": 4}
CHUNK = 16
BASELINE = (0, 0, 0)
KERNELS = ("fwd", "bwd_fwd", "bwd_bwd")


def _stages(text: str) -> tuple[int, int, int]:
    parts = tuple(int(x) for x in text.split(","))
    if len(parts) != 3 or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"a variant is fwd,bwd_fwd,bwd_bwd depths >= 0, e.g. 1,0,0; got {text!r}")
    return parts


def variant(args) -> int:
    """One variant, in this process: build, check against the baseline's tensors, time; write ``args.out``."""
    import torch

    from nam_plugin_mamba_ssm import mimo, patches, upstream
    from nam_plugin_mamba_ssm.scan import MambaSSMScan
    from nam_plugin_mamba_ssm.selftest import INPUT_NAMES, random_inputs
    from nam_core.testing import max_rel_error
    from timing import TimedLaunches, median_ms

    upstream.install_shim()
    patches.apply_needed()
    mimo.STAGES = mimo.Stages(*args.stages)
    logs = {k: [] for k in KERNELS}
    switch = {"on": False}
    real = mimo.compiled

    def compiled(*a, **kw):  # the drivers look the kernels up on every call
        kernels = real(*a, **kw)
        return mimo.Kernels(*(TimedLaunches(getattr(kernels, k), logs[k], switch) for k in KERNELS))

    mimo.compiled = compiled
    scan = MambaSSMScan()
    activations = {"q", "k", "v", "z", "trap"}
    record = {"stages": list(args.stages), "rows": []}
    for b in args.batch:
        x = random_inputs(b, SHAPE["l"], SHAPE["h"], SHAPE["g"], SHAPE["n"], SHAPE["p"], SHAPE["r"],
                          device="cuda", seed=1234 + b)
        gen = torch.Generator(device="cpu").manual_seed(4321 + b)
        dout = torch.randn(b, SHAPE["l"], SHAPE["h"], SHAPE["p"], generator=gen).to("cuda", torch.bfloat16)
        leaves = {k: None if t is None else t.to(torch.bfloat16 if k in activations else t.dtype,
                                                 copy=True).requires_grad_() for k, t in x.items()}

        def step():
            for t in leaves.values():
                if t is not None:
                    t.grad = None
            out = scan(*(leaves[k] for k in INPUT_NAMES), chunk_size=CHUNK)
            out.backward(dout)
            return out

        t0 = time.perf_counter()
        out = step()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        tensors = {"out": out.detach().float().cpu(),
                   **{f"d{k}": t.grad.float().cpu() for k, t in leaves.items() if t is not None}}
        ref_path = args.ref / f"b{b}.pt"
        if tuple(args.stages) == BASELINE:
            torch.save(tensors, ref_path)
            diff = {k: 0.0 for k in tensors}
        else:
            ref = torch.load(ref_path, weights_only=True)  # dict of tensors this script saved
            diff = {k: max_rel_error(tensors[k], ref[k]) for k in tensors}
        total = median_ms(step, warmup=args.warmup, iters=args.iters)
        for k in KERNELS:
            logs[k].clear()
        switch["on"] = True
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
        switch["on"] = False
        kernel_ms = {k: statistics.median(s.elapsed_time(e) for s, e in logs[k]) for k in KERNELS}
        record["rows"].append({"batch": b, "first_call_s": first_s, "scan_ms": total, "kernel_ms": kernel_ms,
                               "worst_diff": max(diff.values()), "diff": diff})
        print(f"stages {args.stages} b={b}: scan {total:.2f} ms, kernels "
              + ", ".join(f"{k} {v:.2f}" for k, v in kernel_ms.items()) + f", worst diff {max(diff.values()):.1e}",
              flush=True)
    args.out.write_text(json.dumps(record) + "\n")
    return 0


def main_run(args) -> int:
    variants = [BASELINE] + [v for v in args.variants if v != BASELINE]
    results = []
    with tempfile.TemporaryDirectory(prefix="nam-mimo-stages-") as tmp:  # the baseline's tensors: ~0.5 GB
        work = Path(tmp)
        for stages in variants:
            out = work / ("stages-" + "-".join(map(str, stages)) + ".json")
            cmd = [sys.executable, __file__, "_variant", "--stages", ",".join(map(str, stages)), "--batch",
                   ",".join(map(str, args.batch)), "--ref", str(work), "--out", str(out), "--warmup",
                   str(args.warmup), "--iters", str(args.iters)]
            print(f"[{','.join(map(str, stages))}] building and timing ...", flush=True)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
                error = None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["exit"])[-1][:300]
            except subprocess.TimeoutExpired:
                error = f"no result within {args.timeout} s (build or kernel hang)"
            if error is None:
                results.append({**json.loads(out.read_text()), "wall_s": time.perf_counter() - t0})
            else:
                if stages == BASELINE:
                    print(f"error: the baseline variant failed: {error}", file=sys.stderr)
                    return 1
                results.append({"stages": list(stages), "error": error, "wall_s": time.perf_counter() - t0})
            print(f"  {error or 'ok'} ({time.perf_counter() - t0:.0f} s)", flush=True)

    import torch

    base = {r["batch"]: r for r in results[0]["rows"]}
    print(f"\nMamba-3 MIMO kernels by pipelining depth (fwd, bwd_fwd, bwd_bwd), sequence {SHAPE['l']}, "
          f"{SHAPE['h']} heads of {SHAPE['p']}, {SHAPE['g']} groups, d_state {SHAPE['n']}, rank {SHAPE['r']}, "
          f"chunk {CHUNK}, bf16, {torch.cuda.get_device_name()}; ms per launch (median of {args.iters})\n")
    print("| stages | batch | fwd ms | bwd_fwd ms | bwd_bwd ms | scan fwd+bwd ms | vs 0,0,0 | worst diff vs 0,0,0 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        name = ",".join(map(str, r["stages"]))
        if "error" in r:
            print(f"| {name} | - | fails: {r['error']} | | | | | |")
            continue
        for row in r["rows"]:
            k = row["kernel_ms"]
            ratio = base[row["batch"]]["scan_ms"] / row["scan_ms"]
            print(f"| {name} | {row['batch']} | {k['fwd']:.2f} | {k['bwd_fwd']:.2f} | {k['bwd_bwd']:.2f} "
                  f"| {row['scan_ms']:.2f} | {ratio:.3f}x | {row['worst_diff']:.1e} |")
    if args.json:
        import importlib.metadata as md

        meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "versions": {d: md.version(d) for d in ("mamba-ssm", "tilelang")},
                "shape": SHAPE, "chunk": CHUNK, "warmup": args.warmup, "iters": args.iters}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def main() -> int:
    common = argparse.ArgumentParser(add_help=False)  # what the run hands to each variant's process
    common.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    common.add_argument("--warmup", type=int, default=3)
    common.add_argument("--iters", type=int, default=10)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[common])
    sub = ap.add_subparsers(dest="command")
    ap.add_argument("--variants", nargs="+", type=_stages, default=[(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0),
                                                                     (0, 0, 1)], help="fwd,bwd_fwd,bwd_bwd depths")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per variant, build included")
    ap.add_argument("--json", type=Path, default=None)
    v = sub.add_parser("_variant", help=argparse.SUPPRESS, parents=[common])
    v.add_argument("--stages", type=_stages, required=True)
    v.add_argument("--ref", type=Path, required=True)
    v.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    return variant(args) if args.command == "_variant" else main_run(args)


if __name__ == "__main__":
    sys.exit(main())
