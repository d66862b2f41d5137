"""Loss curves: the tiny NAM56R trained in bf16 and in FP8 (float8 plugin: linears rowwise + experts rowwise),
same seed, same data, on one GPU; the FP8 curve must stay within a stated band of the bf16 one.

Each run is ``nam train`` itself (the product path: activation with the plugin's parity self-tests, the
``nam_transform_model`` hook in the local engine, the ``float8-grouped`` experts), on the ``nam56r-tiny``
recipe with every width divisible by 16 (``mamba_rope_fraction=1.0`` makes the Mamba in_proj 544 wide), bf16,
CUDA, the reference Mamba/MLA/CE backends by name (the tiny widths are below the kernel plugins' shapes), and
the experts in bf16 on the reference path for the baseline::

    bf16   --set moe_backend=reference
    fp8    --plugins float8 --set float8.linears=rowwise --set float8.experts=rowwise --set moe_backend=float8-grouped

Prints both curves every 20 steps, the mean of each over the last 20 steps and the largest per-step gap there;
passes when ``|mean(fp8) - mean(bf16)| < BAND`` (exit 1 otherwise). About a minute per run on an H100.

    python bench/float8_loss.py --json bench/results/float8_loss.json
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

BAND = 0.05
"""nats: |mean of the last 20 LM losses, FP8 - bf16|. FP8 rounding (~4% relative per GEMM operand) moves the
trajectory, not where it goes; a broken scale or a wrong expert shows as a gap of tenths of a nat or a
diverging curve."""
LAST = 20
COMMON = ["--recipe", "nam56r-tiny", "--device", "cuda", "--quiet",
          "--set", "train.dtype=bfloat16", "--set", "mamba_rope_fraction=1.0",
          "--set", "attention_backend=reference", "--set", "ssm_backend=reference",
          "--set", "train.checkpoint_every=100000"]
RUNS = {
    "bf16": ["--set", "moe_backend=reference"],
    "fp8": ["--plugins", "float8", "--set", "float8.linears=rowwise", "--set", "float8.experts=rowwise",
            "--set", "moe_backend=float8-grouped"],
}


def train(name: str, extra: list[str], *, steps: int, seed: int, root: Path) -> tuple[list[float], float, str]:
    """One ``nam train`` run; its per-step LM loss, its wall time and its run.log."""
    run_dir = root / name
    cmd = [sys.executable, "-m", "nam_cli", "train", *COMMON, *extra, "--max-steps", str(steps),
           "--seed", str(seed), "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NAM_PLUGINS": ""})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{name}: `{' '.join(cmd)}` exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    from nam_core.engine.metrics import read_metrics

    metrics = read_metrics(run_dir)
    key = "lm_loss" if "lm_loss" in metrics[0] else "loss"
    return [m[key] for m in metrics], wall, (run_dir / "run.log").read_text()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--json", type=Path, help="write the curves and the verdict here")
    args = ap.parse_args()
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    curves, walls, logs = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="float8_loss_") as tmp:
        for name, extra in RUNS.items():
            curves[name], walls[name], logs[name] = train(name, extra, steps=args.steps, seed=args.seed,
                                                          root=Path(tmp))
    bf16, fp8 = curves["bf16"], curves["fp8"]
    n = min(len(bf16), len(fp8))
    tail = slice(max(0, n - LAST), n)
    mean = {k: sum(c[tail]) / len(c[tail]) for k, c in curves.items()}
    diff = mean["fp8"] - mean["bf16"]
    max_gap = max(abs(a - b) for a, b in zip(bf16[tail], fp8[tail]))
    ok = abs(diff) < BAND
    converted = [line for line in logs["fp8"].splitlines() if "Float8Linear" in line]

    print(f"tiny NAM56R, {args.steps} steps, seed {args.seed}, {gpu}")
    print(f"{'step':>6} {'bf16':>8} {'fp8':>8} {'fp8-bf16':>9}")
    for i in range(0, n, 20):
        print(f"{i + 1:>6} {bf16[i]:8.4f} {fp8[i]:8.4f} {fp8[i] - bf16[i]:+9.4f}")
    print(f"last {LAST} steps: mean bf16 {mean['bf16']:.4f}, fp8 {mean['fp8']:.4f}, diff {diff:+.4f} nats "
          f"(band +-{BAND}), largest per-step gap {max_gap:.4f}")
    print(f"wall: bf16 {walls['bf16']:.0f} s, fp8 {walls['fp8']:.0f} s (startup included)")
    print(converted[0] if converted else "fp8 run.log has no Float8Linear line: the linears were NOT converted")
    print("PASS" if ok and converted else "FAIL")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "gpu": gpu, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
            "seed": args.seed, "commands": {k: COMMON + v for k, v in RUNS.items()}, "band_nats": BAND,
            "last": LAST, "mean_last": mean, "diff": diff, "max_gap_last": max_gap, "pass": ok and bool(converted),
            "converted": converted, "curves": curves, "wall_s": walls,
        }, indent=2) + "\n")
    return 0 if ok and converted else 1


if __name__ == "__main__":
    raise SystemExit(main())
