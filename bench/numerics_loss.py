"""Loss curves under each optimizer numerics (``train.optimizer_numerics``): the tiny NAM56R in bf16, same data,
on one GPU, over a schedule whose learning rate decays far enough that bf16 rounds small updates away.

Five ``nam train`` runs side by side (the product path: the local engine, its optimizer, its checkpoints off)::

    fp32-master          the record's numerics and the default (fp32 master weights and moments)
    fp32-master, seed+1  the same with the next seed (another initialisation, the same data): the noise band
    bf16-moments         fp32 masters, bf16 moments (torchao's AdamW)
    stochastic-rounding  bf16 parameters updated with stochastic rounding (torchao's AdamW)
    bf16                 bf16 parameters and moments, round-to-nearest (the local engine before issue 30)

The schedule: ``train.lr=1e-3`` after 20 warmup steps, cosine down to ``min_lr_ratio=0.01`` (1e-5) at the last
step. Why it is long enough: a weight of the tiny model's typical size (init std 0.02) has a bf16 ulp of 2^-13
(1.2e-4), so an Adam step of ``lr x |m / sqrt(v)|`` (about 0.3 lr late in a run) is rounded away once lr falls
below about 2e-4: the last ~30% of the steps (from ~70% of the cosine on). A run long enough to show the
effect needs that stretch to move the loss; 300 steps gives it ~90 steps, and the five runs finish in about
six minutes on one H200 (an estimate from ``bench/float8_loss.py``'s 200 steps of five tiny runs in 269 s;
torchao compiles its per-parameter step once per shape, which the first minute pays).

Prints the curves every 25 steps and a table of each run's mean LM loss over the last ``LAST`` steps against
the fp32-master band (its mean +- the seed-to-seed gap, at least ``BAND``); ``--png`` draws the curves
(matplotlib); ``--json`` writes it all. A numerics may become a recipe default only if its mean is inside the
band (issue 30). On the CPU (``--device cpu``, for tests) it runs the same at any size ``--set`` gives it.

    python bench/numerics_loss.py --png bench/results/numerics_loss.png --json bench/results/numerics_loss.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 300
LAST = 30
"""Steps the final mean takes (the last 10%: all inside the stretch where bf16 loses updates)."""
BAND = 0.02
"""nats: the band's half-width at least (a seed-to-seed gap that happens to be tiny is not the noise)."""
SCHEDULE = ["--set", "train.lr=1e-3", "--set", "train.min_lr_ratio=0.01", "--set", "train.warmup_steps=20"]
RUNS = {
    "fp32-master": "fp32-master",
    "fp32-master, seed+1": "fp32-master",
    "bf16-moments": "bf16-moments",
    "stochastic-rounding": "stochastic-rounding",
    "bf16": "bf16",
}
"""Run name -> its ``train.optimizer_numerics``."""
SEED_OFFSET = {"fp32-master, seed+1": 1}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def command(name: str, *, steps: int, seed: int, root: Path, device: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "nam_cli", "train", "--recipe", "nam56r-tiny", "--device", device, "--quiet",
            # the reference attention core by name: on CUDA the host refuses it for DSA unless asked for
            "--set", "attention_backend=reference",
            "--set", "train.dtype=bfloat16", "--set", f"train.optimizer_numerics={RUNS[name]}",
            "--set", f"train.total_steps={steps}", "--set", "train.checkpoint_every=0", *SCHEDULE, *extra,
            "--max-steps", str(steps), "--seed", str(seed + SEED_OFFSET.get(name, 0)),
            "--run-dir", str(root / slug(name))]


def train_all(names: list[str], *, steps: int, seed: int, root: Path, device: str, extra: list[str]) -> tuple[dict, dict]:
    """Every run of ``names`` at once (tiny models fit side by side on one GPU; the curves do not depend on the
    timing): each run's per-step LM loss and wall time. A failed run stops the bench with its output."""
    from nam_core.engine.metrics import read_metrics

    procs, started = {}, time.perf_counter()
    for name in names:
        log = open(root / f"{slug(name)}.out", "w+")
        cmd = command(name, steps=steps, seed=seed, root=root, device=device, extra=extra)
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, "NAM_PLUGINS": ""}), log, cmd)
    curves, walls, failed = {}, {}, []
    for name, (proc, log, cmd) in procs.items():
        proc.wait()
        walls[name] = time.perf_counter() - started
        log.seek(0)
        if proc.returncode != 0:
            failed.append(f"{name}: `{' '.join(cmd)}` exited {proc.returncode}\n{log.read()[-3000:]}")
            continue
        metrics = read_metrics(root / slug(name))
        curves[name] = [m["lm_loss"] for m in metrics]
    if failed:
        sys.exit("\n\n".join(failed))
    return curves, walls


def verdict(curves: dict[str, list[float]], last: int = LAST) -> dict:
    """Each run's mean LM loss over the last ``last`` steps, against the fp32-master band: its mean +- the gap
    to the second seed (at least ``BAND``). ``inside``: per run, whether its mean lies in the band."""
    mean = {k: sum(c[-last:]) / len(c[-last:]) for k, c in curves.items()}
    ref = mean["fp32-master"]
    seed_gap = abs(mean["fp32-master, seed+1"] - ref) if "fp32-master, seed+1" in mean else 0.0
    half = max(BAND, seed_gap)
    return {"mean_last": mean, "band": [ref - half, ref + half], "half_width": half, "seed_gap": seed_gap,
            "vs_fp32_master": {k: m - ref for k, m in mean.items()},
            "inside": {k: abs(m - ref) <= half for k, m in mean.items()}}


def table(v: dict) -> list[str]:
    lines = [f"| numerics | mean LM loss, last {LAST} | vs fp32-master | inside the band "
             f"[{v['band'][0]:.4f}, {v['band'][1]:.4f}] |", "|---|---|---|---|"]
    for k, m in v["mean_last"].items():
        lines.append(f"| {k} | {m:.4f} | {v['vs_fp32_master'][k]:+.4f} | {'yes' if v['inside'][k] else 'NO'} |")
    return lines


def check_png_support() -> None:
    """``--png`` needs matplotlib: refused before any training, naming the package."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("--png needs matplotlib, which is not importable here: pip install matplotlib (or drop --png)")


def plot(curves: dict[str, list[float]], v: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=1)
    ax.axhspan(*v["band"], color="grey", alpha=0.2, label=f"fp32-master band (last {LAST} steps)")
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss (nats)")
    ax.set_title(title)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def redraw(saved: Path, png: Path | None) -> int:
    """The table, and the PNG when asked, of a run saved with ``--json``."""
    if png:
        check_png_support()
    d = json.loads(saved.read_text())
    v = verdict(d["curves"], d["last"])
    print("\n".join(table(v)))
    if png:
        plot(d["curves"], v, png, f"tiny NAM56R, bf16, {d['steps']} steps, {d['device']}")
        print(f"wrote {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--runs", type=lambda s: s.split(";"), default=list(RUNS),
                    help=f"';'-separated among: {'; '.join(RUNS)} (fp32-master always runs)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra `nam train --set` overrides")
    ap.add_argument("--png", type=Path, help="draw the curves here (matplotlib)")
    ap.add_argument("--json", type=Path, help="write the curves and the table here")
    ap.add_argument("--from-json", type=Path, help="train nothing: print the table of a saved --json and draw "
                    "--png from it (the GPU host has no matplotlib)")
    args = ap.parse_args(argv)
    if args.from_json:
        return redraw(args.from_json, args.png)
    if set(args.runs) - set(RUNS):
        ap.error(f"--runs: among {'; '.join(RUNS)}, found {'; '.join(args.runs)}")
    if args.png:
        check_png_support()
    names = ["fp32-master", *(n for n in args.runs if n != "fp32-master")]
    import torch

    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    extra = [a for s in args.sets for a in ("--set", s)]
    with tempfile.TemporaryDirectory(prefix="numerics_loss_") as tmp:
        curves, walls = train_all(names, steps=args.steps, seed=args.seed, root=Path(tmp), device=args.device,
                                  extra=extra)
    last = min(LAST, args.steps)
    v = verdict(curves, last)
    print(f"tiny NAM56R, bf16, {args.steps} steps (lr 1e-3 -> 1e-5 cosine), seed {args.seed}, {where}; LM loss")
    print(f"{'step':>6} " + " ".join(f"{k:>20}" for k in curves))
    for i in list(range(0, args.steps, 25)) + [args.steps - 1]:
        print(f"{i + 1:>6} " + " ".join(f"{c[i]:20.4f}" for c in curves.values()))
    print("\n".join(table(v)))
    print("wall (side by side, startup included): " + ", ".join(f"{k} {w:.0f} s" for k, w in walls.items()))
    if args.png:
        plot(curves, v, args.png, f"tiny NAM56R, bf16, {args.steps} steps, {where}")
        print(f"wrote {args.png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": where, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
            "seed": args.seed, "runs": {k: command(k, steps=args.steps, seed=args.seed, root=Path("RUN"),
                                                   device=args.device, extra=extra) for k in names},
            "last": last, **v, "curves": curves, "wall_s": walls}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
