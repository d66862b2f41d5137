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
from typing import Any, Callable

import torch

from nam_core.engine import checkpoint, numerics
from nam_core.engine.config import TrainConfig
from nam_core.engine.contract import EngineRun, Ranks
from nam_core.engine.metrics import MetricsLog
from nam_core.engine.rundir import StopRequests, stopped
from nam_core.engine.step import first_non_finite, lr_lambda, step_metrics
from nam_core.engine.summary import mark as mark_phase
from nam_core.engine.validation import mean_loss
from nam_core.errors import ConfigError, Interrupted, TrainingGuardError


@dataclass
class LocalModel:
    """What the local engine trains: ``module`` (its parameters, its train mode) and ``forward(batch,
    micro_batch_id) -> dict`` with at least ``loss`` (a model package builds it: ``nam56r.run.build``)."""

    module: torch.nn.Module
    forward: Callable[[dict, int], dict]


class LocalEngine:
    """One process on the CPU or one GPU (``nam_core.engine.contract.Engine``)."""

    name = "local"

    def start(self, spec, *, dry_run: bool, relaunch=None) -> Ranks:
        return Ranks()

    def good_checkpoints(self, ckpt_root: Path) -> list[Path]:
        return checkpoint.good_checkpoints(ckpt_root)

    def check_ahead(self, ckpt_root: Path) -> None:
        checkpoint.good_checkpoints(ckpt_root)

    def resolve_resume(self, spec: str, ckpt_root: Path, *, warn: Callable[[str], None]) -> Path:
        return checkpoint.resolve_resume(spec, ckpt_root, warn=warn)

    def barrier(self) -> None:
        pass

    def train(self, run: EngineRun) -> dict:
        return train(run)

    def finish(self) -> None:
        pass


@dataclass
class _State:
    """What ``_start`` set up for the loop."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    log: MetricsLog
    start: int
    noted: set = field(default_factory=set)
    saver: Any = None
    """The background checkpoint writer (``train.async_checkpoints``), made after the first step (its host
    buffers start being built then) or at the first save."""


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW under ``train.optimizer_numerics`` (nam_core/engine/numerics.py: fp32 masters or not, moment
    dtypes, fused on CUDA); no weight decay on vectors (norm weights, biases, per-head scalars)."""
    return numerics.make_optimizer(model.parameters(), numerics=cfg.optimizer_numerics, weight_decay=cfg.weight_decay,
                                   lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def _memory_gib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    # Peak resident set of this process (Linux reports KiB).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _drain_notes(run: EngineRun, state: _State) -> None:
    """Log each pending note once (selected fields before step 0; blocks' ForwardState.log lines after)."""
    while run.notes:
        line = run.notes.pop(0)
        if line not in state.noted:
            state.noted.add(line)
            state.log.note(line)


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
        numerics.set_group_lr(group, cfg.lr * factor)  # a tensor under torchao's AdamW
        group["weight_decay"] = decay
    scheduler._last_lr = [float(group["lr"]) for group in optimizer.param_groups]


def _continue_from(run: EngineRun, module, optimizer, scheduler) -> int:
    """``run.optimizer_from``: the optimizer's state and the LR schedule at its step, where the run goes on."""
    exported = run.optimizer_from
    try:
        numerics.fill_state(optimizer, module.named_parameters(), dict(exported.state), exported.step)
    except ValueError as e:  # a model a plugin's transform changed, or an export of another layout
        raise ConfigError(f"--init-from: {e}", hint="start from the weights alone (an export without "
                                                     "--with-optimizer)") from None
    scheduler.last_epoch = exported.step
    resume_schedule(optimizer, scheduler, run.train)
    return exported.step


def _start(run: EngineRun) -> _State:
    """Optimizer, schedule and log; the checkpoint's state when resuming."""
    cfg, module = run.train, run.model.module
    run.notes.extend(run.host.transform_model(module, run.spec))  # nam_transform_model: before the optimizer
    optimizer = make_optimizer(module, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    folder = run.folder
    start, cut = 0, []
    if run.resume_from is not None:
        loading = time.perf_counter()
        manifest = checkpoint.load(run.resume_from, model=module, optimizer=optimizer, scheduler=scheduler)
        loading = time.perf_counter() - loading
        resume_schedule(optimizer, scheduler, cfg)
        start = manifest["step"]
        cut = folder.truncate_metrics(start)
    elif run.optimizer_from is not None:
        start = _continue_from(run, module, optimizer, scheduler)
    state = _State(optimizer, scheduler, folder.metrics_log(start_step=start, total_steps=run.max_steps,
                                                             quiet=run.quiet), start)
    if run.resume_from is not None:
        state.log.note(f"resumed from {run.resume_from} at step {start} (loaded in {loading:.1f} s)")
    for line in cut:
        state.log.note(line)
    _drain_notes(run, state)
    return state


def _step(run: EngineRun, state: _State, step: int, last_good: Path | None) -> tuple[dict, int]:
    """One optimizer step; its metrics line and its token count."""
    cfg, module = run.train, run.model.module
    ctx = run.context(step, parameters=module.named_parameters, note=state.log.note)
    run.host.before_step(step, ctx)
    t0 = time.perf_counter()
    module.train()
    totals: dict[str, float] = {}
    n_tokens = 0
    for micro in range(cfg.grad_accum):
        index = step * cfg.grad_accum + micro
        batch = {k: v.to(cfg.device) for k, v in run.batch_at(index, cfg.micro_batch_size).items()}
        out = run.model.forward(batch, index)
        (out["loss"] / cfg.grad_accum).backward()
        for key, value in out.items():
            totals[key] = totals.get(key, 0.0) + value.detach().float().item() / cfg.grad_accum
        n_tokens += batch["tokens"].numel()
    params = [p for p in module.parameters() if p.grad is not None]
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    if not (math.isfinite(totals["loss"]) and math.isfinite(grad_norm)):
        # A lower lr from the last good checkpoint; with none, the folder starts afresh (rundir.plan).
        retry = run.continue_command(resume="auto" if last_good else None, sets={"train.lr": f"{cfg.lr / 10:g}"})
        raise TrainingGuardError(
            f"non-finite {'loss' if not math.isfinite(totals['loss']) else 'gradient norm'} at step "
            f"{step}: first non-finite is {first_non_finite(module)}; "
            f"last good checkpoint: {last_good or 'none'}",
            hint=f"{'resume from it' if last_good else 'start again'} with a lower lr: {retry}",
        )
    lr = float(state.scheduler.get_last_lr()[0])  # a tensor under torchao's AdamW
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    metrics = step_metrics(step, totals, lr=lr, grad_norm=grad_norm, tokens=n_tokens,
                           seconds=time.perf_counter() - t0, flops_per_token=run.flops_per_token,
                           mem_gib=_memory_gib(cfg.device))
    run.host.after_step(step, ctx, metrics)
    return metrics, n_tokens


def evaluate(run: EngineRun) -> dict:
    """``{"val_loss": ...}``: the LM loss on the held-out rows (nam_core/engine/validation.py), no gradients,
    the model in eval mode for the pass and back in train mode after it."""
    cfg, module = run.train, run.model.module
    n = run.held_out.micro_batches(eval_tokens=cfg.eval_tokens, micro_batch_size=cfg.micro_batch_size)
    total = 0.0
    module.eval()
    try:
        with torch.no_grad():
            for i in range(n):
                batch = run.held_out.batch_at(i, cfg.micro_batch_size)
                out = run.model.forward({k: v.to(cfg.device) for k, v in batch.items()}, i)
                total += out["lm_loss"].float().item()
    finally:
        module.train()
    return {"val_loss": mean_loss(total, n)}


def _save(run: EngineRun, state: _State, step: int, last_good: Path | None, *, wait: bool) -> Path | None:
    """Checkpoint ``step``; the newest checkpoint on disk after it. With ``train.async_checkpoints`` the files are
    written in the background (nam_core/engine/async_checkpoint.py): the save before it is waited for, and this
    one too when ``wait`` (the last step, a stop)."""
    root, cfg, module = run.folder.checkpoints, run.train, run.model.module
    if not cfg.async_checkpoints:
        t0 = time.perf_counter()
        saved = checkpoint.save(root, step, model=module, optimizer=state.optimizer, scheduler=state.scheduler,
                                extra={"record": run.record}, keep=cfg.keep_checkpoints)
        state.log.note(f"checkpoint {saved}: training paused {time.perf_counter() - t0:.1f} s (written on the "
                       "training thread)", echo=False)
        return saved
    if state.saver is None:
        state.saver = checkpoint_saver(cfg)
    t0, previous = time.perf_counter(), state.saver.pending
    last_good = _finish_save(run, state) or last_good
    if previous is not None:  # training stood still until the previous write ended: part of this save's cost
        state.log.note(f"checkpoint {root / f'step-{step:08d}'}: training waited {time.perf_counter() - t0:.1f} s for the "
                       "previous checkpoint's background write (train.checkpoint_every steps took less than a "
                       "write)", echo=False)
    pending = checkpoint.start_save(root, step, saver=state.saver, model=module, optimizer=state.optimizer,
                                    scheduler=state.scheduler, extra={"record": run.record}, keep=cfg.keep_checkpoints)
    if pending.buffers is not None:  # the first save of this process took the host buffers into use
        b = pending.buffers
        state.log.note(f"checkpoint {pending.final}: its host buffers ({b.nbytes / 1e9:.1f} GB, {b.how}) took "
                       f"{b.built_s:.1f} s to build on a background thread; the save waited {b.waited_s:.1f} s for "
                       "them (part of its pause)", echo=False)
    return (_finish_save(run, state) or last_good) if wait else last_good


def checkpoint_saver(cfg: TrainConfig):
    """The run's background checkpoint writer; on CUDA its host buffers are page-locked; built once
    (``_prepare_saves``) and kept between saves."""
    from nam_core.engine.async_checkpoint import AsyncSaver

    return AsyncSaver(pinned=cfg.device == "cuda")


def _prepare_saves(run: EngineRun, state: _State) -> None:
    """After the first step of this process: the checkpoint host buffers start being built on a background
    thread (nam_core/engine/async_checkpoint.py), so the first save only copies into them."""
    state.saver = state.saver or checkpoint_saver(run.train)
    b = checkpoint.prepare_save(state.saver, model=run.model.module, optimizer=state.optimizer,
                                scheduler=state.scheduler)
    state.log.note(f"checkpoint host buffers: building {b.nbytes / 1e9:.1f} GB ({b.how}) on a background thread",
                   echo=False)


def _finish_save(run: EngineRun, state: _State) -> Path | None:
    """Wait for the save in flight; note what it cost (the stall, the background write); its folder."""
    pending = state.saver.pending
    done = checkpoint.finish_save(state.saver, run.folder.checkpoints, run.model.module, state.optimizer)
    if pending is not None:
        waited = f", {pending.buffers.waited_s:.1f} s of it waiting for the host buffers" if pending.buffers else ""
        state.log.note(f"checkpoint {done}: training paused {pending.stall_s:.1f} s (copy to host memory{waited}), "
                       f"written in {time.perf_counter() - pending.started:.1f} s in the background", echo=False)
    return done


def _stopped(run: EngineRun, stop: StopRequests, step: int, last_good: Path | None) -> Interrupted:
    return stopped(stop.signum, step, run.max_steps, last_good, saves=run.checkpoints and run.train.checkpoint_every > 0,
                   continue_with=run.continue_command(resume="auto"))


def train(run: EngineRun) -> dict:
    """Train from the start (or the checkpoint) to ``max_steps``. SIGINT/SIGTERM stop it after the current
    step with a checkpoint of that step (Interrupted, exit 130/143), unless ``checkpoint_every`` is 0."""
    cfg = run.train
    with StopRequests() as stop:
        state = _start(run)
        mark_phase("engine")
        good = checkpoint.good_checkpoints(run.folder.checkpoints)
        last_good = good[-1] if good else None
        tokens_per_step = first_step_done_at = None
        try:
            if stop.signum is not None:  # asked to stop while loading: nothing new to save
                raise _stopped(run, stop, state.start, last_good)
            for step in range(state.start, run.max_steps):
                metrics, tokens_per_step = _step(run, state, step, last_good)
                if first_step_done_at is None and run.checkpoints and cfg.async_checkpoints and cfg.checkpoint_every:
                    _prepare_saves(run, state)  # the optimizer's state exists now: its host buffers, in the background
                first_step_done_at = first_step_done_at or time.time()  # the summary's launch-to-first-step
                _drain_notes(run, state)
                if cfg.evaluates_after(step + 1, run.max_steps):
                    metrics.update(evaluate(run))
                if (step + 1) % cfg.log_every == 0 or step in (state.start, run.max_steps - 1) \
                        or "val_loss" in metrics or stop.signum is not None:
                    state.log.log(metrics)
                state.log.advance()
                saves = cfg.saves_after(step + 1, run.max_steps) or (stop.signum is not None and cfg.checkpoint_every)
                if run.checkpoints and saves:
                    last_good = _save(run, state, step + 1, last_good,
                                      wait=stop.signum is not None or step + 1 == run.max_steps)
                if stop.signum is not None:
                    raise _stopped(run, stop, step + 1, last_good)
            report = run.host.run_report(run.context(run.max_steps, parameters=run.model.module.named_parameters,
                                                     note=state.log.note))
        finally:
            if state.saver is not None and state.saver.pending is not None:  # an error mid-run: the save in
                _finish_save(run, state)  # flight still lands (or is removed)
            state.log.close()
    return {"steps": run.max_steps, "started_at_step": state.start, "last_checkpoint": str(last_good),
            "tokens_per_step": tokens_per_step, "first_step_done_at": first_step_done_at, "plugin_report": report}
