"""Where step metrics go: metrics.jsonl always, a progress bar on a terminal (plain lines otherwise),
TensorBoard event files in ``<run folder>/tensorboard`` when the tensorboard package is installed (the
``[tensorboard]`` extra: ``pip install -e ".[tensorboard]"``; ``tensorboard --logdir <run folder>/tensorboard``). One-off notes (a plugin's hand-over, the
fields plugins selected) go to the terminal and to ``run.log`` in the run folder, even under ``--quiet``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tqdm import tqdm

from nam_core.errors import DataError
from nam_core.files import write_atomic


class MetricsLog:
    def __init__(self, run_dir: Path, *, start_step: int, total_steps: int, quiet: bool = False):
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a crash loses at most one line
        self._notes = open(run_dir / "run.log", "a", buffering=1)
        self.step = start_step
        self.tty = sys.stderr.isatty() and not quiet
        self.quiet = quiet
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True) if self.tty else None
        self.tb = None
        if importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step)

    def log(self, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        step = metrics["step"]
        if self.tb is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
        line = f"step {step} {step_line(metrics)}"
        if "val_loss" in metrics:
            line += f" val_loss {metrics['val_loss']:.4f}"
        if self.bar is not None:
            self.bar.set_postfix_str(step_line(metrics))
        elif not self.quiet:
            print(line, file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.step += 1
        if self.bar is not None:
            self.bar.update(1)

    def note(self, message: str, *, echo: bool = True) -> None:
        """A one-off message (plugin hand-over, checkpoint saved), without breaking the bar. A ``warning: ``
        line is shown even under --quiet (something was skipped that the user should know about).
        ``echo=False``: run.log only (each checkpoint saved; the summary names the newest)."""
        self._notes.write(f"[step {self.step}] {message}\n")
        if not echo:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stderr)
        elif not self.quiet or message.startswith("warning: "):
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self._file.close()
        self._notes.close()


def step_line(metrics: dict) -> str:
    """A step's numbers as the progress line shows them: the LM loss (the loss the summary reports), the other
    loss terms apart in brackets (MTP, router balance, the indexer's KL: they move for their own reasons), then
    lr, grad norm and speed."""
    from nam_core.engine.summary import STEP_FIELDS

    lm = metrics.get("lm_loss", metrics["loss"])  # a model without the split logs one loss
    others = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())
                       if k not in STEP_FIELDS and isinstance(v, (int, float)))
    return (f"LM loss {lm:.4f}{f' ({others})' if others else ''} lr {metrics['lr']:.2e} "
            f"grad_norm {metrics['grad_norm']:.3f} tok/s {metrics['tokens_per_s']:.0f}")


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir``'s metrics.jsonl ([] without one). A last line that is not whole JSON (a kill
    mid-write, as ``truncate_metrics`` says) is left out; any other line that is not a JSON record is a DataError
    (exit 4) that names it."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif i < len(lines) - 1:
            raise DataError(f"{path} line {number} is not a JSON record: {line[:80]!r}",
                            hint="the file was edited or damaged; remove that line (a resume rewrites the file "
                                 "up to its checkpoint)")
    return records


def truncate_metrics(run_dir: Path, last_step: int) -> list[str]:
    """Drop metrics lines after the checkpoint a run resumes from (they will be produced again), and lines
    that are not JSON: a kill mid-write leaves a torn last line. Returns what was cut, as notes."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    keep, torn = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            torn.append(number)
            continue
        if step <= last_step:
            keep.append(line)
    write_atomic(path, "".join(l + "\n" for l in keep))  # a kill mid-rewrite keeps the old file
    if not torn:
        return []
    which = "its last line" if torn == [number] else f"line(s) {', '.join(map(str, torn))}"
    return [f"metrics.jsonl: cut {which}, not a whole JSON record (a write cut short by a kill or a full disk)"]
