"""Benchmark: the Mamba-3 MIMO scan at NAM56R's shape, upstream's kernels (dynamic, static) against nam's.

Rows, each built and timed in its own process (so each one's compile, first call and peak memory are its own):

* ``mamba-ssm dynamic``: mamba-ssm 2.3.2.post1's TileLang kernels built as its drivers build them, with
  batch, length, heads and groups dynamic (nam's lane without the static-shapes entry): the default baseline
  (``--baseline ROW`` picks another, e.g. ``mamba-ssm-static`` where the dynamic build would cost too long);
* ``mamba-ssm static``: the same kernels built for the exact sizes (the ``mamba3-mimo-static-shapes`` entry);
* ``mimo-scan``: nam's own chunk-parallel Triton kernels (``nam-plugin-mimo-scan``), as the host builds it
  (its forward keeps the chunk states for the backward inside nam's activation checkpoint only);
* ``mimo-scan-kept``: the same with ``keep_states=True``: the backward skips its state walk and phase kernel,
  at 1.5 GiB more (b2: the states and the phase table) held from the forward to the backward.

``--recompute`` runs every row's scan under nam's activation checkpoint (``nam56r.recompute.checkpointed``) as
the Mamba-3 mixer does under ``train.recompute=mamba-scan``: the replay asks the backend's ``for_backward_only``
(mamba-ssm skips its forward kernel; mimo-scan runs only the phase and the state walk, whose results it keeps
for the backward). The forward is timed as the first pass; forward + backward includes the replay.

Shape: sequence 4096, 128 heads of 64, 8 groups, d_state 128, rank 4, chunk 16, bf16 activations, the scan's
fp32 inputs as the mixer hands them. Per row and batch: the forward's median time (with autograd recording, as
in training), forward + backward, the backward as their difference, mamba-ssm's three kernels one by one, the
peak memory of one forward + backward above the inputs, the first call's wall time (compile or cache read), and
the largest difference of the output and every input gradient from the baseline row, relative to that
tensor's largest magnitude.

    python bench/mimo_scan.py --batch 1,2 --json bench/results/mimo_scan.json [--profile DIR]
    python bench/mimo_scan.py --batch 2 --rows mamba-ssm-static mimo-scan --baseline mamba-ssm-static

``--profile DIR`` writes each row's per-kernel CUDA time of one forward + backward at the last batch
(torch.profiler, ``DIR/mimo-scan-<row>-b<batch>.txt``).
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
ROWS = ("mamba-ssm-dynamic", "mamba-ssm-static", "mimo-scan", "mimo-scan-kept")
BASELINE = ROWS[0]
KERNELS = ("fwd", "bwd_fwd", "bwd_bwd")
RECOMPUTED = "; every row under nam's activation checkpoint (the forward replayed in the backward)"


def _scan(row: str, logs: dict, switch: dict):
    """The ``SSMScan`` of ``row``; mamba-ssm's kernels wrapped so each launch can be timed."""
    if row.startswith("mimo-scan"):
        from nam_plugin_mimo_scan.scan import MimoScan

        return MimoScan(keep_states=True if row == "mimo-scan-kept" else None)
    from nam_plugin_mamba_ssm import mimo, patches, upstream
    from nam_plugin_mamba_ssm.scan import MambaSSMScan
    from timing import TimedLaunches

    upstream.install_shim()
    if row == BASELINE:  # the lane without its static-shapes entry, which the scan would otherwise insist on
        for name, patch in patches.make_patches().items():
            if name != patches.STATIC and patch.state()[0] == "needed":
                patch.apply()
        patches.require_mimo_fixes = lambda: None
    else:
        patches.apply_needed()
    assert mimo.STATIC == (row == "mamba-ssm-static")
    real = mimo.compiled

    def compiled(*a, **kw):
        kernels = real(*a, **kw)
        return mimo.Kernels(*(TimedLaunches(getattr(kernels, k), logs[k], switch) for k in KERNELS))

    mimo.compiled = compiled
    return MambaSSMScan()


def one_row(args) -> int:
    """One row, in this process: build, time, compare with the baseline's tensors; write ``args.out``."""
    import torch

    from nam56r.recompute import checkpointed
    from nam_core.testing import max_rel_error
    from nam_plugin_mamba_ssm.selftest import INPUT_NAMES, random_inputs
    from timing import median_ms

    logs, switch = {k: [] for k in KERNELS}, {"on": False}
    scan = _scan(args.row, logs, switch)
    activations = {"q", "k", "v", "z", "trap"}
    record = {"row": args.row, "recompute": args.recompute, "batches": []}
    for b in args.batch:
        x = random_inputs(b, SHAPE["l"], SHAPE["h"], SHAPE["g"], SHAPE["n"], SHAPE["p"], SHAPE["r"],
                          device="cuda", seed=1234 + b)
        x["angles"] = x["angles"][:, :, :1].contiguous()  # one set for every head, as the mixer makes them
        gen = torch.Generator(device="cpu").manual_seed(4321 + b)
        dout = torch.randn(b, SHAPE["l"], SHAPE["h"], SHAPE["p"], generator=gen).to("cuda", torch.bfloat16)
        leaves = {k: None if t is None else t.to(torch.bfloat16 if k in activations else t.dtype,
                                                 copy=True).requires_grad_() for k, t in x.items()}

        per_head = {"angles": lambda a: a.expand(-1, -1, SHAPE["h"], -1)}  # the mixer's broadcast view

        def forward():
            tensors = [per_head.get(k, lambda t: t)(leaves[k]) for k in INPUT_NAMES]
            if not args.recompute:
                return scan(*tensors, chunk_size=CHUNK)
            passes = []

            def between(*a):  # as the Mamba-3 mixer runs it: the replay's output is not read
                passes.append(None)
                fn = scan if len(passes) == 1 else getattr(scan, "for_backward_only", scan)
                return fn(*a[:-1], chunk_size=CHUNK)

            return checkpointed(between, None, *tensors)

        def step():
            for t in leaves.values():
                if t is not None:
                    t.grad = None
            out = forward()
            out.backward(dout)
            return out

        t0 = time.perf_counter()
        out = step()
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        tensors = {"out": out.detach().float().cpu(),
                   **{f"d{k}": t.grad.float().cpu() for k, t in leaves.items() if t is not None}}
        ref_path = args.ref / f"b{b}.pt"
        if args.row == args.baseline:
            torch.save(tensors, ref_path)
            diff = {k: 0.0 for k in tensors}
        else:
            ref = torch.load(ref_path, weights_only=True)  # dict of tensors this script saved
            diff = {k: max_rel_error(tensors[k], ref[k]) for k in tensors}
        del out
        fwd_ms = median_ms(forward, warmup=args.warmup, iters=args.iters)
        total_ms = median_ms(step, warmup=args.warmup, iters=args.iters)
        for k in KERNELS:
            logs[k].clear()
        switch["on"] = True
        for _ in range(args.iters):
            step()
        torch.cuda.synchronize()
        switch["on"] = False
        kernel_ms = {k: statistics.median(s.elapsed_time(e) for s, e in logs[k]) for k in KERNELS if logs[k]}
        for t in leaves.values():
            if t is not None:
                t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            args.profile.mkdir(parents=True, exist_ok=True)
            (args.profile / f"mimo-scan-{args.row}-b{b}.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=25) + "\n")
        record["batches"].append({"batch": b, "first_call_s": first_s, "fwd_ms": fwd_ms, "bwd_ms": total_ms - fwd_ms,
                                  "scan_ms": total_ms, "kernel_ms": kernel_ms, "peak_gib": peak,
                                  "worst_diff": max(diff.values()), "diff": diff})
        print(f"{args.row} b={b}: fwd {fwd_ms:.2f} ms, fwd+bwd {total_ms:.2f} ms, peak {peak:.2f} GiB, "
              f"worst diff {max(diff.values()):.1e}", flush=True)
    args.out.write_text(json.dumps(record) + "\n")
    return 0


def main_run(args) -> int:
    rows = [args.baseline] + [r for r in args.rows if r != args.baseline]
    results = []
    with tempfile.TemporaryDirectory(prefix="nam-mimo-scan-") as tmp:  # the baseline's tensors (~1 GB at b=2)
        work = Path(tmp)
        for row in rows:
            out = work / f"{row}.json"
            cmd = [sys.executable, __file__, "_row", "--row", row, "--batch", ",".join(map(str, args.batch)),
                   "--ref", str(work), "--out", str(out), "--warmup", str(args.warmup), "--iters", str(args.iters),
                   "--baseline", args.baseline]
            if args.recompute:
                cmd.append("--recompute")
            if args.profile:
                cmd += ["--profile", str(args.profile)]
            print(f"[{row}] building and timing ...", flush=True)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
                sys.stdout.write(proc.stdout)
                error = None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["exit"])[-1][:300]
                if error:
                    sys.stderr.write(proc.stderr[-3000:])
            except subprocess.TimeoutExpired:
                error = f"no result within {args.timeout} s (build or kernel hang)"
            if error is None:
                results.append({**json.loads(out.read_text()), "wall_s": time.perf_counter() - t0})
            else:
                if row == args.baseline:
                    print(f"error: the baseline row failed: {error}", file=sys.stderr)
                    return 1
                results.append({"row": row, "error": error, "wall_s": time.perf_counter() - t0})
            print(f"  {error or 'ok'} ({time.perf_counter() - t0:.0f} s)", flush=True)

    import torch

    base = {r["batch"]: r for r in results[0]["batches"]}
    print(f"\nMamba-3 MIMO scan, sequence {SHAPE['l']}, {SHAPE['h']} heads of {SHAPE['p']}, {SHAPE['g']} groups, "
          f"d_state {SHAPE['n']}, rank {SHAPE['r']}, chunk {CHUNK}, bf16, {torch.cuda.get_device_name()}; ms "
          f"(median of {args.iters}); mamba-ssm's kernels fwd / bwd_fwd / bwd_bwd per launch; baseline "
          f"{args.baseline}{RECOMPUTED if args.recompute else ''}\n")
    print("| row | batch | fwd ms | bwd ms | scan fwd+bwd ms | vs baseline | kernels ms | peak GiB | first call s "
          "| worst diff vs baseline |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['row']} | - | fails: {r['error']} | | | | | | | |")
            continue
        for row in r["batches"]:
            k = row["kernel_ms"]
            kernels = " / ".join(f"{k[name]:.2f}" for name in KERNELS) if k else "-"
            ratio = base[row["batch"]]["scan_ms"] / row["scan_ms"]
            print(f"| {r['row']} | {row['batch']} | {row['fwd_ms']:.2f} | {row['bwd_ms']:.2f} | {row['scan_ms']:.2f} "
                  f"| {ratio:.2f}x | {kernels} | {row['peak_gib']:.2f} | {row['first_call_s']:.0f} "
                  f"| {row['worst_diff']:.1e} |")
    if args.json:
        import importlib.metadata as md

        versions = {}
        for dist in ("mamba-ssm", "tilelang", "triton", "nam-plugin-mimo-scan"):
            try:
                versions[dist] = md.version(dist)
            except md.PackageNotFoundError:
                versions[dist] = None
        meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "versions": versions, "shape": SHAPE, "chunk": CHUNK,
                "warmup": args.warmup, "iters": args.iters, "recompute": args.recompute}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def main() -> int:
    common = argparse.ArgumentParser(add_help=False)  # what the run hands to each row's process
    common.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    common.add_argument("--warmup", type=int, default=3)
    common.add_argument("--iters", type=int, default=10)
    common.add_argument("--profile", type=Path, default=None, help="folder for per-kernel profiles")
    common.add_argument("--recompute", action="store_true",
                        help="each row's scan under nam's activation checkpoint (train.recompute=mamba-scan)")
    common.add_argument("--baseline", choices=ROWS, default=BASELINE,
                        help="the row the others are timed and compared against (runs first)")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], parents=[common])
    sub = ap.add_subparsers(dest="command")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--timeout", type=int, default=420, help="seconds per row, builds included")
    ap.add_argument("--json", type=Path, default=None)
    r = sub.add_parser("_row", help=argparse.SUPPRESS, parents=[common])
    r.add_argument("--row", choices=ROWS, required=True)
    r.add_argument("--ref", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    return one_row(args) if args.command == "_row" else main_run(args)


if __name__ == "__main__":
    sys.exit(main())
