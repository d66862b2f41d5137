"""``nam plot RUN_DIR [RUN_DIR...]``: a run's curves against the step, to a PNG; several runs overlaid.

Five panels from each folder's metrics.jsonl: the training LM loss (``lm_loss``; ``loss`` for a model that logs
no split), the validation LM loss (``val_loss``, on the steps that evaluated), the learning rate, the gradient
norm and tokens/s per device. matplotlib is an optional package (nam's ``plot`` extra); without it the command
is a ConfigError that names it. Drawn off-screen (the Agg backend): no display needed. The PNG is rendered in
memory and written in one rename (``nam_core.files.write_atomic``): an interrupted or failed plot leaves the file
that was there, never a torn one; a --out whose folder is missing is refused before anything is read.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Annotated

import typer

from nam_cli.console import out

PANELS = (("lm_loss", "training LM loss"), ("val_loss", "validation LM loss"), ("lr", "learning rate"),
          ("grad_norm", "gradient norm"), ("tokens_per_s", "tokens/s per device"))
"""(metrics field, panel title), in drawing order."""


def pyplot():
    """matplotlib's pyplot on the Agg backend, or a ConfigError that says how to install it."""
    from nam_core.errors import ConfigError

    try:
        import matplotlib
    except ImportError:
        raise ConfigError("nam plot needs the 'matplotlib' package, which is not installed",
                          hint="pip install matplotlib  (or, from a nam checkout: pip install -e '.[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def curves(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Field -> (steps, values) of one run folder's metrics.jsonl, for the fields of ``PANELS``."""
    from nam_core.engine.metrics import read_metrics
    from nam_core.errors import ConfigError

    records = read_metrics(run_dir)
    if not records:
        raise ConfigError(f"{run_dir} has no metrics.jsonl records to plot",
                          hint="point at a run folder that trained at least one step (runs/NAME)")
    lm = "lm_loss" if any("lm_loss" in r for r in records) else "loss"
    out: dict[str, tuple[list[int], list[float]]] = {}
    for field, _ in PANELS:
        key = lm if field == "lm_loss" else field
        pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        out[field] = ([s for s, _ in pairs], [v for _, v in pairs])
    return out


def draw(run_dirs: list[Path]):
    """The figure: one panel per field of ``PANELS``, one line per run (labelled with its folder)."""
    plt = pyplot()
    runs = {_label(d, run_dirs): curves(d) for d in run_dirs}
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.4 * len(PANELS)), sharex=True)
    for ax, (field, title) in zip(axes, PANELS):
        for label, data in runs.items():
            steps, values = data[field]
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=label)
        if not any(data[field][0] for data in runs.values()):
            ax.text(0.5, 0.5, "not logged" + (" (train.eval_every)" if field == "val_loss" else ""),
                    ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title, fontsize=10, loc="left")
        if field in ("lm_loss", "val_loss"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def _label(run_dir: Path, all_dirs: list[Path]) -> str:
    """The folder's name, or its last two parts when another run shares the name."""
    same = [d for d in all_dirs if d.name == run_dir.name]
    return run_dir.name if len(same) == 1 else f"{run_dir.parent.name}/{run_dir.name}"


def plot(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run folders (runs/NAME), overlaid in one figure.")],
    out_path: Annotated[Path, typer.Option("--out", help="The PNG to write.")] = Path("nam-plot.png"),
) -> None:
    """Plot training and validation LM loss, learning rate, gradient norm and tokens/s against the step."""
    _check_writable(out_path)
    fig = draw(run_dirs)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    _write(out_path, png.getvalue())
    out.print(f"wrote {out_path} ({len(run_dirs)} run{'s' if len(run_dirs) > 1 else ''}: "
              f"{', '.join(_label(d, run_dirs) for d in run_dirs)})")


def _check_writable(out_path: Path) -> None:
    """--out names a file in an existing folder (checked before the runs are read and drawn)."""
    from nam_core.errors import ConfigError

    folder = out_path.parent
    if not folder.is_dir():
        raise ConfigError(f"cannot write {out_path}: {folder} is not a folder",
                          hint=f"mkdir -p {folder}  (or pass --out in an existing folder)")
    if out_path.is_dir():
        raise ConfigError(f"cannot write {out_path}: it is a folder", hint=f"pass --out {out_path / 'nam-plot.png'}")


def _write(out_path: Path, data: bytes) -> None:
    from nam_core.errors import RunFolderError
    from nam_core.files import write_atomic

    try:
        write_atomic(out_path, data)
    except OSError as exc:
        raise RunFolderError(f"cannot write {out_path}: {exc.strerror or exc}",
                             hint="pass --out in a folder this user can write, with free space") from exc
