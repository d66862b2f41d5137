"""The end-of-run summary (``summary.json`` and the last line ``nam train`` prints), from the metrics records.

One step's loss is noisy, and the total ``loss`` includes the MTP and auxiliary losses (router balance, the
indexer's KL), which move for their own reasons. So the summary reports the LM loss (``lm_loss``) averaged over
a window of steps at the start and at the end, each other loss term averaged over the end window apart from
it, the last validation LM loss (``val_loss``, nam_core/engine/validation.py) when the run evaluated, and the
run's speed.

The speed it leads with is the steady state: the median step after this invocation's first one (tokens/s and
model TFLOP/s per device, as the engines log them). The first step builds kernels and warms allocators and
caches (NAM56R, one H200: ~20 s against ~1.7 s for each later step), so an average over the wall time that
includes it understates a run's speed by 1.7x at 10 steps (issue 31); the first step's time is reported
apart, with the time from the command's launch to the end of that step (``launch_to_first_step_s``: start-up,
model build, checkpoint load and the first step; a resume's time to its first step), and the wall average
(checkpoints included) stays in ``summary.json`` as ``tokens_per_s``.

Both engines write the same records (``nam_core.engine.local``, ``nam_core.engine.megatron.loop``): a record is
the step's numbers; every numeric field that is not one of ``STEP_FIELDS`` is a loss term.
"""

from __future__ import annotations

import math
import os
import time
from statistics import fmean, median

STEP_FIELDS = frozenset({"step", "loss", "lm_loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device",
                         "mem_gib", "step_time_s", "val_loss"})
"""Fields of a metrics record that are not auxiliary training-loss terms (``loss`` is their sum with
``lm_loss``; ``val_loss``, on the steps that evaluated, is the held-out LM loss)."""

WINDOW_FRACTION, WINDOW_MAX = 0.1, 20
"""The window: the last 10% of the logged steps (a short run's first steps are far above its end), at most 20
(a long run's summary says where it ended, not an average over thousands of steps), at least one."""


def window(n_records: int) -> int:
    """How many records the start and end averages take, out of ``n_records``."""
    return max(1, min(WINDOW_MAX, math.ceil(n_records * WINDOW_FRACTION)))


LAUNCHED_AT = "NAM_LAUNCHED_AT"
"""The environment variable holding when ``nam`` started (``time.time()``), set by the first ``nam`` process and
inherited by the ranks it launches, so a rank measures the time to its first step from the command's start."""


def mark_launch() -> None:
    """Note this process's start as the launch, unless a parent ``nam`` process already did."""
    os.environ.setdefault(LAUNCHED_AT, f"{time.time():.3f}")


STARTUP_PHASES = ("resolve", "self-tests", "model", "data", "engine", "first step")
"""The start-up's phases, in order, each named by what ends it (``mark``): the command resolved (Python's and the
packages' imports, the recipe, the plugins' config checks; under ``--nproc N`` with N > 1 the torchrun launch too),
the device probed and the plugins activated (their launch self-tests build or load kernels), the megatron engine's
model built (the local engine builds its own in ``engine``), the data opened (prepared when not in the cache), the
engine started (the local model, the optimizer, Megatron's DDP wrapper, a checkpoint loaded), the first step. A
resume's check of its checkpoints (their sha256) runs on a background thread from the engine's start, beside the
self-tests; what the run folder's check still waits for of it counts in ``engine``."""

_marks: dict[str, float] = {}
_self_tests: dict[str, float] = {}


def note_self_tests(rows) -> None:
    """Keep how long each launch check of the activation took (``Check.seconds``), for the summary's
    ``self_tests_s``: the breakdown of the ``self-tests`` phase."""
    _self_tests.clear()
    _self_tests.update({f"{r.plugin}: {r.name}": r.seconds for r in rows if r.seconds is not None})


def mark(phase: str) -> None:
    """Note that start-up phase ``phase`` (one of ``STARTUP_PHASES``) ends now, for the summary's breakdown."""
    if phase not in STARTUP_PHASES:
        raise ValueError(f"start-up phase {phase!r}: expected one of {', '.join(STARTUP_PHASES)}")
    _marks[phase] = time.time()


def startup(first_step_done_at: float | None) -> dict[str, float] | None:
    """Seconds each start-up phase took, from the launch to the end of the first step (the phases sum to
    ``launch_to_first_step``); a phase this process did not mark is left out (its time goes to the next one), and
    so is a mark outside the launch and the first step (left by an earlier run in the same process: a test, a
    bench). None without the launch or the first step."""
    launched = os.environ.get(LAUNCHED_AT)
    if first_step_done_at is None or not launched:
        return None
    ends = {**_marks, "first step": first_step_done_at}
    out, previous = {}, float(launched)
    for phase in STARTUP_PHASES:
        if phase in ends and previous <= ends[phase] <= first_step_done_at:
            out[phase] = round(ends[phase] - previous, 3)
            previous = ends[phase]
    return out


def launch_to_first_step(first_step_done_at: float | None) -> float | None:
    """Seconds from the launch (``mark_launch``) to the end of this invocation's first step (``time.time()`` the
    engine returned), or None when either is unknown."""
    launched = os.environ.get(LAUNCHED_AT)
    if first_step_done_at is None or not launched:
        return None
    return round(first_step_done_at - float(launched), 3)


def summarize(records: list[dict], *, wall_s: float, steps_run: int, tokens_per_step: int | None,
              first_step: int = 1, first_step_done_at: float | None = None) -> dict:
    """The summary's numbers. ``records``: the run folder's metrics records (a resumed run's earlier ones too);
    ``wall_s``, ``steps_run`` and ``tokens_per_step``: this invocation's training (tokens over every rank);
    ``first_step``: the number (from 1) of this invocation's first step, the one whose time is reported apart;
    ``first_step_done_at``: when it ended (``time.time()``), for the time from the launch to it."""
    tokens = (tokens_per_step or 0) * steps_run
    summary = {"wall_time_s": round(wall_s, 3), "steps_run": steps_run, "tokens": tokens,
               "tokens_per_s": tokens / wall_s if wall_s > 0 and tokens else None, **steady_state(records, first_step),
               "launch_to_first_step_s": launch_to_first_step(first_step_done_at),
               "startup_s": startup(first_step_done_at),
               "self_tests_s": dict(sorted(_self_tests.items(), key=lambda kv: -kv[1])) or None}
    evaluated = [r for r in records if isinstance(r.get("val_loss"), (int, float))]
    summary.update(val_loss_last=evaluated[-1]["val_loss"] if evaluated else None,
                   val_loss_step=evaluated[-1]["step"] if evaluated else None)
    if not records:
        return dict(summary, loss_window=0, lm_loss_first=None, lm_loss_last=None, loss_last=None,
                    other_losses_last={})
    n = window(len(records))
    first, last = records[:n], records[-n:]
    lm = "lm_loss" if all("lm_loss" in r for r in records) else "loss"  # a model without the split logs one
    aux = sorted({k for r in last for k, v in r.items() if k not in STEP_FIELDS and isinstance(v, (int, float))})
    summary.update(
        loss_window=n, lm_loss_first=_mean(first, lm), lm_loss_last=_mean(last, lm), loss_last=_mean(last, "loss"),
        other_losses_last={k: _mean(last, k) for k in aux},
    )
    return summary


def steady_state(records: list[dict], first_step: int) -> dict:
    """This invocation's speed: the median over its logged steps after ``first_step`` of each step's own
    ``tokens_per_s``, ``tflops_per_device`` and ``step_time_s`` (None when no such step was logged: a one-step
    run has no steady state), and ``first_step_s``, the time of step ``first_step`` (None when not logged)."""
    later = [r for r in records if r.get("step", 0) > first_step]
    first = [r for r in records if r.get("step") == first_step]

    def med(key: str) -> float | None:
        values = [r[key] for r in later if isinstance(r.get(key), (int, float))]
        return median(values) if values and len(values) == len(later) else None

    return {"step_tokens_per_s": med("tokens_per_s"), "step_tflops_per_device": med("tflops_per_device"),
            "step_time_s": med("step_time_s"), "steady_steps": len(later),
            "first_step_s": first[-1].get("step_time_s") if first else None}


def numerics_fields(train) -> dict:
    """What the run trained with beyond its losses: the optimizer numerics and the activation recompute."""
    from nam_core.engine.config import recompute_kinds
    from nam_core.engine.numerics import describe as numerics

    return {"numerics": numerics(train.optimizer_numerics, train.dtype), "recompute": list(recompute_kinds(train))}


def describe(summary: dict) -> str:
    """The summary as the one line ``nam train`` prints at the end."""
    parts = [f"done: {summary['steps_run']} steps in {_duration(summary['wall_time_s'])}"]
    if summary.get("tokens"):
        parts.append(f"{summary['tokens']:,} tokens")
    speed = _speed(summary)
    if speed:
        parts.append(speed)
    if summary.get("lm_loss_last") is not None:
        n = summary["loss_window"]
        parts.append(f"LM loss {summary['lm_loss_first']:.4f} -> {summary['lm_loss_last']:.4f} (mean of the "
                     f"{'first and last ' + str(n) + ' logged steps' if n > 1 else 'first and last logged step'})")
        others = ", ".join(f"{k} {v:.4g}" for k, v in summary["other_losses_last"].items())
        if others:
            parts.append(f"other losses at the end: {others}")
    if summary.get("val_loss_last") is not None:
        parts.append(f"validation LM loss {summary['val_loss_last']:.4f} at step {summary['val_loss_step']}")
    parts.append(f"run folder {summary.get('run_dir')}")
    return "; ".join(parts)


def _speed(summary: dict) -> str:
    """'9,478 tokens/s, 85.1 TFLOP/s per device at the median step after the first (first step 22.1 s: kernel
    builds, warm-up; 5,543 tokens/s over the wall time)'; the wall average alone when no later step ran."""
    first, launched = summary.get("first_step_s"), summary.get("launch_to_first_step_s")
    first = f"first step {_duration(first)}: kernel builds, warm-up" if first is not None else ""
    if first and launched is not None:
        first += f"; it ended {_duration(launched)} after launch"
        phases = summary.get("startup_s")
        if phases and len(phases) > 1:
            first += f" ({', '.join(f'{k} {_duration(v)}' for k, v in phases.items())})"
    wall = f"{summary['tokens_per_s']:,.0f} tokens/s over the wall time" if summary.get("tokens_per_s") else ""
    if summary.get("step_tokens_per_s") is None:
        return "; ".join(x for x in (wall + (" (no step after the first to measure)" if wall else ""), first) if x)
    tflops = summary.get("step_tflops_per_device")
    rate = f"{summary['step_tokens_per_s']:,.0f} tokens/s" + (f", {tflops:.3g} TFLOP/s" if tflops is not None else "")
    return f"{rate} per device at the median step after the first ({'; '.join(x for x in (first, wall) if x)})"


def _mean(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return fmean(values) if values else None


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def where_lines(summary: dict) -> list[str]:
    """The lines after the summary: what each plugin did in the run (``plugin_report``, from the plugins'
    ``nam_run_report``: a plugin that did nothing says so), then where the run's things are
    (``nam_core.engine.rundir.whereabouts``): each a label and a path or a whole command, never wrapped, so
    they can be copied."""
    lines = [f"plugin {line}" for line in summary.get("plugin_report") or ()]
    lines.append(f"checkpoint: {summary.get('checkpoint') or 'none (train.checkpoint_every=0)'}")
    if summary.get("continue_with"):
        lines.append(f"{summary['continue_what']}:")
        lines.append(f"  {summary['continue_with']}")
    logs = f"metrics: {summary.get('metrics')} (one JSON line per logged step); notes: {summary.get('run_log')}"
    lines.append(logs)
    if summary.get("tensorboard"):
        lines.append(f"tensorboard: tensorboard --logdir {summary['tensorboard']}")
    return lines
