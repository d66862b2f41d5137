"""The local engine: one process, CPU or one GPU. The reference loop every other engine is compared with.

Per optimizer step: ``nam_before_step``; ``grad_accum`` micro-batches of forward + backward; the global
grad norm (clipped); the NaN/Inf guard; the optimizer and LR-schedule step; one metrics line;
``nam_after_step``; a checkpoint every ``checkpoint_every`` steps and at the end (none at 0), and after the
step in progress when SIGINT or SIGTERM asks the run to stop (it then exits 130/143, saying how to go on).

Resume is bit-exact: model, optimizer, LR schedule and RNG come from the checkpoint, and the data order is a
pure function of (seed, step), so step N of a resumed run sees what step N of an uninterrupted run saw.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from nam_core.engine import checkpoint
from nam_core.engine.config import TrainConfig
from nam_core.engine.metrics import MetricsLog, truncate_metrics
from nam_core.engine.rundir import StopRequests, stopped
from nam_core.errors import Interrupted, TrainingGuardError
from nam_core.run import RunSpec, StepContext


@dataclass
class LocalRun:
    """Everything one run needs. ``forward(batch, micro_batch_id) -> dict`` must return ``loss``."""

    run_dir: Path
    train: TrainConfig
    model: torch.nn.Module
    forward: Callable[[dict, int], dict]
    batch_at: Callable[[int, int], dict]
    host: Any
    max_steps: int
    flops_per_token: float
    record: dict = field(default_factory=dict)
    """Identity of the run (config, plugins) stored in every checkpoint manifest."""
    resume_from: Path | None = None
    quiet: bool = False
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    log: MetricsLog | None = None
    step: int = 0
    notes: list[str] = field(default_factory=list)
    """Lines for the run log, each logged once: before the first step (the fields requested plugins
    selected) and after each step (what ``forward`` appended, e.g. blocks' ``ForwardState.log``)."""
    spec: RunSpec | None = None
    """The run the plugins were activated for; lifecycle hooks read it through their ``StepContext``."""
    backends: Mapping[str, Any] = field(default_factory=dict)
    """Kind -> the backend object the model runs (``StepContext.backend``)."""
    again: Callable[..., str] | None = None
    """``again(resume="auto", sets={"train.lr": "3e-05"})``: the command that continues this run, for the
    hints of a stop or a guard (the CLI knows the options it was started with)."""

    def context(self, step: int) -> StepContext:
        """What the lifecycle hooks of step ``step`` receive."""
        if self.spec is None:
            raise TypeError("LocalRun.spec is unset: build the run through nam56r.run (the composition root)")
        return StepContext(step=step, spec=self.spec, backends=self.backends, parameters=self.model.named_parameters,
                           note=lambda line: self.log.note(line) if self.log is not None else None,
                           max_steps=self.max_steps)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup to the peak, cosine decay to ``min_lr_ratio`` at ``total_steps``, flat after."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on vectors (norm weights, biases, per-head scalars).

    On CUDA it runs torch's fused implementation: one kernel per parameter group and dtype instead of the
    multi-tensor path's dozen passes over the state (NAM56R, one H200, MBS 2: 64.6 ms of a 966 ms step on the
    multi-tensor path, bench/README.md). Elsewhere torch's default."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    on_cuda = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=True if on_cuda else None,
    )


def _memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    # Peak resident set of this process (Linux reports KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def first_non_finite(model: torch.nn.Module) -> str:
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            return f"parameter {name}"
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return f"gradient of {name}"
    return "none (the loss itself is non-finite)"


def _drain_notes(run: LocalRun) -> None:
    """Log each pending note once (selected fields before step 0; blocks' ForwardState.log lines after)."""
    seen = run.__dict__.setdefault("_noted", set())
    while run.notes:
        line = run.notes.pop(0)
        if line not in seen:
            seen.add(line)
            run.log.note(line)


def resume_schedule(optimizer: torch.optim.Optimizer, scheduler, cfg: TrainConfig) -> None:
    """After a load, this run's LR schedule and weight decay, not the checkpoint's.

    The checkpoint's optimizer and scheduler carry the peak lr (``base_lrs``) and weight decay they were
    saved with; a resume may change those fields (``rundir.RESUMABLE``), and a silently restored old lr is
    the bug this prevents. With unchanged fields every number is the one the scheduler computed itself
    (``base_lr * lambda(step)``), so a plain resume stays bit-exact."""
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for group, decay in zip(optimizer.param_groups, (cfg.weight_decay, 0.0)):  # make_optimizer's two groups
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * factor
        group["weight_decay"] = decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def _again(run: LocalRun, **changes) -> str:
    if run.again is not None:
        return run.again(**changes)
    return f"nam train --run-dir {run.run_dir} --resume auto (with this run's other options)"


def _start(run: LocalRun) -> int:
    """Optimizer, schedule and log; the checkpoint's state when resuming. Returns the first step."""
    cfg = run.train
    run.notes.extend(run.host.transform_model(run.model, run.spec))  # nam_transform_model: before the optimizer
    run.optimizer = make_optimizer(run.model, cfg)
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lr_lambda(cfg))
    start, cut = 0, []
    if run.resume_from is not None:
        manifest = checkpoint.load(run.resume_from, model=run.model, optimizer=run.optimizer,
                                   scheduler=run.scheduler)
        resume_schedule(run.optimizer, run.scheduler, cfg)
        start = manifest["step"]
        cut = truncate_metrics(run.run_dir, start)
    run.log = MetricsLog(run.run_dir, start_step=start, total_steps=run.max_steps, quiet=run.quiet)
    if run.resume_from is not None:
        run.log.note(f"resumed from {run.resume_from} at step {start}")
    for line in cut:
        run.log.note(line)
    _drain_notes(run)
    return start


def _step(run: LocalRun, step: int, last_good: Path | None) -> tuple[dict, int]:
    """One optimizer step; its metrics line and its token count."""
    cfg = run.train
    ctx = run.context(step)
    run.host.before_step(step, ctx)
    t0 = time.perf_counter()
    run.model.train()
    totals: dict[str, float] = {}
    n_tokens = 0
    for micro in range(cfg.grad_accum):
        batch = run.batch_at(step * cfg.grad_accum + micro, cfg.micro_batch_size)
        out = run.forward(batch, step * cfg.grad_accum + micro)
        (out["loss"] / cfg.grad_accum).backward()
        for key, value in out.items():
            totals[key] = totals.get(key, 0.0) + value.detach().float().item() / cfg.grad_accum
        n_tokens += batch["tokens"].numel()
    params = [p for p in run.model.parameters() if p.grad is not None]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    if not (math.isfinite(totals["loss"]) and math.isfinite(grad_norm)):
        # A lower lr from the last good checkpoint; with none, the folder starts afresh (rundir.plan).
        retry = _again(run, resume="auto" if last_good else None, sets={"train.lr": f"{cfg.lr / 10:g}"})
        raise TrainingGuardError(
            f"non-finite {'loss' if not math.isfinite(totals['loss']) else 'gradient norm'} at step "
            f"{step}: first non-finite is {first_non_finite(run.model)}; "
            f"last good checkpoint: {last_good or 'none'}",
            hint=f"{'resume from it' if last_good else 'start again'} with a lower lr: {retry}",
        )
    lr = run.scheduler.get_last_lr()[0]
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens_per_s = n_tokens / dt
    metrics = {"step": step + 1, **{k: round(v, 6) for k, v in totals.items()}, "lr": lr,
               "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
               "tflops_per_device": tokens_per_s * run.flops_per_token / 1e12,
               "mem_gib": _memory_gib(cfg.device), "step_time_s": dt}
    run.host.after_step(step, ctx, metrics)
    return metrics, n_tokens


def _save(run: LocalRun, step: int) -> Path:
    path = checkpoint.save(run.run_dir / "checkpoints", step, model=run.model, optimizer=run.optimizer,
                           scheduler=run.scheduler, extra={"record": run.record}, keep=run.train.keep_checkpoints)
    run.log.note(f"checkpoint saved: {path}", echo=False)
    return path


def _stopped(run: LocalRun, stop: StopRequests, step: int, last_good: Path | None) -> Interrupted:
    return stopped(stop.signum, step, run.max_steps, last_good, saves=run.train.checkpoint_every > 0,
                   continue_with=_again(run, resume="auto"))


def train(run: LocalRun) -> dict:
    """Train from the start (or the checkpoint) to ``max_steps``. SIGINT/SIGTERM stop it after the current
    step with a checkpoint of that step (Interrupted, exit 130/143), unless ``checkpoint_every`` is 0."""
    cfg = run.train
    with StopRequests() as stop:
        start = _start(run)
        good = checkpoint.good_checkpoints(run.run_dir / "checkpoints")
        last_good = good[-1] if good else None
        tokens_per_step = None
        try:
            if stop.signum is not None:  # asked to stop while loading: nothing new to save
                raise _stopped(run, stop, start, last_good)
            for step in range(start, run.max_steps):
                run.step = step
                metrics, tokens_per_step = _step(run, step, last_good)
                _drain_notes(run)
                if (step + 1) % cfg.log_every == 0 or step + 1 == run.max_steps or stop.signum is not None:
                    run.log.log(metrics)
                run.log.advance()
                if cfg.saves_after(step + 1, run.max_steps) or (stop.signum is not None and cfg.checkpoint_every):
                    last_good = _save(run, step + 1)
                if stop.signum is not None:
                    raise _stopped(run, stop, step + 1, last_good)
            report = run.host.run_report(run.context(run.max_steps))
        finally:
            run.log.close()
    return {"steps": run.max_steps, "started_at_step": start, "last_checkpoint": str(last_good),
            "tokens_per_step": tokens_per_step, "plugin_report": report}
