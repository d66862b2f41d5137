"""NAM56R's production topology (issue 9): the memory plan, and the launch and report of the 8x H200 run.

    python bench/production.py plan [--json PATH]                       # any machine: memory per GPU, MBS that fits
    python bench/production.py run --gpus 8 --ep 8 [--mbs N] [--steps 100] [--warmup-steps 20] --json PATH

``--mbs`` defaults to the largest micro-batch that fits an H200 by the plan (4 at EP 8, 3 at EP 4 on 4 GPUs).

``plan``: for PP 1 at EP 4 (4 GPUs) and EP 8 (8 GPUs), the per-GPU memory of the megatron engine by
nam56r/memory.py (static part counted, the rest fitted to 4x H200 runs at EP 4, MBS 1-3) and the largest
micro-batch that fits an H200 by that plan.

``run`` (the GPU host, megatron-core 0.19 importable): ``nam preflight --engine megatron`` with the production
plugins, then ``nam train --recipe nam56r --engine megatron --nproc G --ep E`` with mamba-ssm, sparse-mla,
liger, index-cache and lemyx (``lemyx.warmup_steps`` short, so both phases are seen), bf16, CUDA graphs off.
It reports the lemyx warm-up phase and the sparse phase separately: median tokens/s per GPU over each phase
(the first ``--skip`` steps of each phase left out: compilation, the hand-over), model TFLOP/s per GPU by
nam56r/flops.py and at 31.2 GFLOP/token, the peak memory, and the loss over the run, against the published
record (289 TFLOP/s, ~9,250 tokens/s per GPU at EP 4, MBS 8). ``nam train`` shows its progress bar unless
``--quiet``. If preflight or training exits non-zero, ``run`` prints one error (the exit code, the layout, the
run's log) with the next thing to try, and exits with that code; no report is written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PLUGINS = "mamba-ssm,sparse-mla,liger,index-cache,lemyx"
PUBLISHED = {"tflops_per_gpu": 289.0, "tokens_per_s_per_gpu": 9250.0, "flop_per_token": 31.2e9,
             "topology": "8x H200, PP 1, EP 4, MBS 8, bf16"}
"""NAM56R's published record (issue 8 and 9)."""


def plan(args) -> int:
    from nam56r.memory import (H200_GIB, OUTSIDE_ALLOCATOR_GIB, largest_mbs, load_constants, megatron_estimate,
                                parameter_split)
    from nam56r.recipes import get_recipe

    cfg = get_recipe("nam56r").model
    dense, routed = split = parameter_split(cfg)
    rows = []
    for gpus, ep in ((4, 4), (8, 8), (8, 4)):
        fit = largest_mbs(cfg, world=gpus, ep=ep, split=split)
        for mbs in sorted({1, 2, 4, 8, fit} - {0}):
            p, _ = megatron_estimate(cfg, world=gpus, ep=ep, mbs=mbs, kinds=(), split=split)
            rows.append({**p.to_dict(), "fits_h200": p.fits(), "largest_mbs": fit})
    measured = load_constants().meta
    print(f"\nNAM56R megatron-engine memory per GPU, PP 1, sequence 4096, no recompute ({dense / 1e9:.2f}B dense + "
          f"{routed / 1e9:.2f}B routed-expert parameters); 'other' = the activations measured per block "
          f"(nam56r/activations.json, {measured['gpu']}, {measured['date']}) replayed through the backward; fits = "
          f"total + {OUTSIDE_ALLOCATOR_GIB} GiB outside the allocator <= H200's {H200_GIB} GiB\n")
    print("| GPUs | EP | MBS | bf16 weights GiB | fp32 grads GiB | optimizer shard GiB | other GiB | total GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['world']} | {r['ep']} | {r['mbs']} | {r['weights_gib']:.1f} | {r['grads_gib']:.1f} "
              f"| {r['optimizer_gib']:.1f} | {r['other_gib']:.1f} | {r['total_gib']:.1f} "
              f"| {'yes' if r['fits_h200'] else 'no'} |")
    if args.json:
        _write(args.json, {"meta": {"date": datetime.date.today().isoformat(), "h200_gib": H200_GIB,
                                    "activation_constants": {k: measured[k] for k in ("date", "gpu", "command")},
                                    "outside_allocator_gib": OUTSIDE_ALLOCATOR_GIB}, "rows": rows})
    return 0


def phases(metrics: list[dict], *, warmup_steps: int, skip: int, flops_per_token: float) -> list[dict]:
    """The report's rows: lemyx's warm-up (steps 1..warmup_steps) and the sparse phase after it, each without
    its first ``skip`` steps; median tokens/s per GPU, TFLOP/s both ways, the phase's peak memory. A phase
    with no step left is absent."""
    split = {"warm-up (lemyx dense + indexer KL)": [m for m in metrics if m["step"] <= warmup_steps][skip:],
             "sparse (top-k)": [m for m in metrics if m["step"] > warmup_steps][skip:]}
    rows = []
    for name, ms in split.items():
        if not ms:
            continue
        tokens = statistics.median(m["tokens_per_s"] for m in ms)
        rows.append({"phase": name, "steps": len(ms), "first_step": ms[0]["step"], "last_step": ms[-1]["step"],
                     "tokens_per_s_per_gpu": tokens, "tflops_per_gpu": tokens * flops_per_token / 1e12,
                     "tflops_per_gpu_at_31.2": tokens * PUBLISHED["flop_per_token"] / 1e12,
                     "peak_gib": max(m["mem_gib"] for m in ms),
                     "vs_published_tokens": tokens / PUBLISHED["tokens_per_s_per_gpu"]})
    return rows


def _failed(what: str, code: int, args, run_dir: Path | None) -> int:
    """One error for a step of ``run`` that exited non-zero, with where to look and what to try next."""
    where = f"; its log: {run_dir / 'run.log'}" if run_dir is not None else ""
    nxt = (f"rerun at a smaller micro-batch if it ran out of memory: --mbs {args.mbs - 1}" if args.mbs > 1 else
           "rerun with the output shown (without --quiet) to see the failing rank")
    print(f"error: {what} exited with {code} ({args.gpus} GPUs, EP {args.ep}, MBS {args.mbs}){where}\n"
          f"next: {nxt}", file=sys.stderr)
    return code


def run(args) -> int:
    from nam56r.flops import flops_per_token
    from nam56r.recipes import get_recipe
    from nam_core.engine.metrics import read_metrics

    if args.skip < 1:  # the first step builds kernels: never in a steady-state median (engine/summary.py)
        print(f"error: --skip must leave out at least the first step of each phase, found {args.skip}", file=sys.stderr)
        return 2
    if args.warmup_steps >= args.steps:
        print(f"error: --warmup-steps {args.warmup_steps} leaves no sparse step in --steps {args.steps}",
              file=sys.stderr)
        return 2
    if args.mbs is None:
        from nam56r.memory import largest_mbs

        args.mbs = largest_mbs(get_recipe("nam56r").model, world=args.gpus, ep=args.ep)
        if args.mbs < 1:
            print(f"error: by nam56r/memory.py not even MBS 1 fits an H200 at {args.gpus} GPUs, EP {args.ep}",
                  file=sys.stderr)
            return 2
        print(f"MBS {args.mbs}: the largest that fits an H200 by nam56r/memory.py (--mbs to choose)", flush=True)
    nam = [sys.executable, "-m", "nam_cli"]
    code = subprocess.run([*nam, "preflight", "--engine", "megatron", "--plugins", PLUGINS, "--recipe", "nam56r"]
                          ).returncode
    if code:
        return _failed("nam preflight", code, args, None)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="nam-production-")) / "run"
    cmd = [*nam, "train", "--recipe", "nam56r", "--engine", "megatron", "--nproc", str(args.gpus),
           "--ep", str(args.ep), "--plugins", PLUGINS, "--max-steps", str(args.steps), "--run-dir", str(run_dir),
           "--set", f"train.micro_batch_size={args.mbs}", "--set", f"lemyx.warmup_steps={args.warmup_steps}",
           "--set", "train.checkpoint_every=0",  # nothing to resume: no ~66 GB save at the end
           *(["--quiet"] if args.quiet else [])]
    print(" ".join(cmd[2:]), flush=True)
    code = subprocess.run(cmd).returncode
    if code:
        return _failed("nam train", code, args, run_dir)
    metrics = read_metrics(run_dir)
    flops = flops_per_token(get_recipe("nam56r").model).total
    rows = phases(metrics, warmup_steps=args.warmup_steps, skip=args.skip, flops_per_token=flops)
    print(f"\nNAM56R, {args.gpus}x GPU, PP 1, EP {args.ep}, MBS {args.mbs}, bf16, plugins {PLUGINS}; "
          f"{flops / 1e9:.1f} GFLOP/token by nam56r/flops.py\n")
    print("| phase | steps timed | tokens/s per GPU | TFLOP/s per GPU | at 31.2 GF/token | peak GiB | vs 9,250 tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['first_step']}-{r['last_step']} | {r['tokens_per_s_per_gpu']:,.0f} "
              f"| {r['tflops_per_gpu']:.1f} | {r['tflops_per_gpu_at_31.2']:.1f} | {r['peak_gib']:.1f} "
              f"| {r['vs_published_tokens']:.2f}x |")
    losses = [(m["step"], m["loss"]) for m in metrics]
    print(f"\nloss: step {losses[0][0]} {losses[0][1]:.4f} -> step {losses[-1][0]} {losses[-1][1]:.4f}")
    if args.json:
        import torch

        _write(args.json, {"meta": {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                                    "gpus": args.gpus, "ep": args.ep, "mbs": args.mbs, "steps": args.steps,
                                    "warmup_steps": args.warmup_steps, "skip": args.skip, "plugins": PLUGINS,
                                    "flops_per_token": flops, "published": PUBLISHED},
                           "rows": rows, "loss": losses})
    return 0


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")
    print(f"\nwrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="memory per GPU and the largest MBS that fits, by nam56r/memory.py")
    r = sub.add_parser("run", help="the production run on this GPU host, phase by phase")
    r.add_argument("--gpus", type=int, default=8)
    r.add_argument("--ep", type=int, default=8)
    r.add_argument("--mbs", type=int, default=None, help="default: the largest that fits by the memory plan")
    r.add_argument("--steps", type=int, default=100)
    r.add_argument("--warmup-steps", type=int, default=20, help="lemyx.warmup_steps: dense steps before sparse")
    r.add_argument("--skip", type=int, default=3, help="steps left out at the start of each phase")
    r.add_argument("--run-dir", type=Path, default=None)
    r.add_argument("--quiet", action="store_true", help="no progress bar from nam train (for logs)")
    for q in (p, r):
        q.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    return plan(args) if args.command == "plan" else run(args)


if __name__ == "__main__":
    sys.exit(main())
