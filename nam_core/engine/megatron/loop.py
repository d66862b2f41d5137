"""The megatron engine's loop: ``train(run)`` for an ``EngineRun`` whose model is a ``MegatronModel``.

``train`` checks the process and the layout, applies the engine's patch lane for the run, builds the
process groups, the model chunks the schedule asks for, the optimizer, resumes, then loops: zero the
gradients, one forward-backward through the schedule, nam's learning rate, the optimizer step, the step's
losses and metrics (the local engine's metrics.jsonl lines), the lifecycle hooks, a checkpoint.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nam_core.engine.config import TrainConfig
from nam_core.engine.contract import EngineRun
from nam_core.engine.megatron import checks, checkpoint, optimizer, parallel, patches
from nam_core.engine.megatron.model import build_ddp, unwrap
from nam_core.engine.megatron.schedule import PipelineSchedule, schedule_for
from nam_core.engine.metrics import MetricsLog
from nam_core.engine.rundir import StopRequests, stopped
from nam_core.engine.step import first_non_finite, lr_lambda, step_metrics
from nam_core.engine.summary import mark as mark_phase
from nam_core.engine.validation import mean_loss
from nam_core.errors import ConfigError, Interrupted, TrainingGuardError
from nam_core.patches import applied


@dataclass
class _Session:
    """What ``_start`` set up for the loop."""

    schedule: PipelineSchedule
    models: list
    optimizer: Any
    layout: dict
    dp: int
    dp_rank: int
    start: int
    last_good: Path | None
    tokens_per_step: int
    log: MetricsLog | None = None
    """Rank 0's metrics log (None on the other ranks)."""
    saves: checkpoint.BackgroundSaves | None = None
    """The background checkpoint writer (``train.async_checkpoints``); None: synchronous saves."""
    noted: set = field(default_factory=set)
    first_step_done_at: float | None = None
    """When this invocation's first step ended (``time.time()``), for the summary's time from launch."""

    def note(self, line: str) -> None:
        if self.log is not None:
            self.log.note(line)

    def parameters(self):
        """This rank's trainable parameters by name, over its model chunks (``StepContext.parameters``)."""
        return itertools.chain.from_iterable(unwrap(c).named_parameters() for c in self.models)


def _agreed_stop(stop: StopRequests) -> int:
    """The signal every rank stops for after this step (0: none): the largest signal number any rank received,
    so all ranks save the same checkpoint and leave together even when the signal reached only some of them
    (one all-reduce of one integer per step)."""
    return parallel.max_over_ranks(stop.signum or 0)


def _stopped(run: EngineRun, signum: int, step: int, last_good: Path | None) -> Interrupted:
    return stopped(signum, step, run.max_steps, last_good, saves=run.checkpoints and run.train.checkpoint_every > 0,
                   continue_with=run.continue_command(resume="auto"))


def train(run: EngineRun) -> dict:
    """Train ``run`` on this process's GPU as one rank of the torchrun job; return the summary (all ranks)."""
    checks.prepare_allocator(os.environ, cuda_initialized=torch.cuda.is_initialized(),
                             async_saves=run.checkpoints and run.train.async_checkpoints
                             and run.train.checkpoint_every > 0)
    checks.check_runtime(checks.runtime_facts(), dispatcher=run.train.moe_dispatcher,
                         precision_aware=optimizer.precision_aware(run.train))
    tc, provider, lr_at = run.train, run.model, lr_lambda(run.train)
    with applied(patches.lane()) as patch_reports, StopRequests() as stop:
        s = _start(run, patch_reports)
        mark_phase("engine")
        try:
            if signum := _agreed_stop(stop):  # stopped while the model was built or the checkpoint loaded: no step
                raise _stopped(run, signum, s.start, s.last_good)
            for step in range(s.start, run.max_steps):
                ctx = run.context(step, parameters=s.parameters, note=s.note)
                run.host.before_step(step, ctx)
                t0 = time.perf_counter()
                for model in s.models:
                    model.zero_grad_buffer()
                s.optimizer.zero_grad()
                losses = s.schedule(forward_step_func=provider.forward_step, model=s.models,
                                    data_iterator=_batches(run, step, s.dp_rank, s.dp),
                                    num_microbatches=tc.grad_accum, seq_length=provider.seq_len,
                                    micro_batch_size=tc.micro_batch_size, forward_only=False)
                lr = tc.lr * lr_at(step)
                optimizer.set_lr(s.optimizer, lr, tc.weight_decay)
                update_ok, grad_norm, _ = s.optimizer.step()
                means, notes = _step_means(run, s, losses)
                dt, mem = _peaks(t0)
                if s.first_step_done_at is None:
                    s.first_step_done_at = time.time()  # the summary's launch-to-first-step
                    if s.saves is not None and tc.checkpoint_every:  # the optimizer's state exists now
                        s.saves.prepare(s.models, s.optimizer)  # its host buffers, on a background thread
                grad_norm = float("nan") if grad_norm is None else float(grad_norm)
                _guard(step, update_ok, means["loss"], grad_norm, s)
                metrics = step_metrics(step, means, lr=lr, grad_norm=grad_norm, tokens=s.tokens_per_step,
                                       seconds=dt, flops_per_token=run.flops_per_token, mem_gib=mem,
                                       devices=torch.distributed.get_world_size())  # per GPU
                if tc.evaluates_after(step + 1, run.max_steps):
                    metrics.update(evaluate(run, s))
                run.host.after_step(step, ctx, metrics)
                _log(run, s, step, metrics, notes)
                stopping = _agreed_stop(stop)
                if s.saves is not None:
                    s.last_good = s.saves.poll() or s.last_good
                if run.checkpoints and (tc.saves_after(step + 1, run.max_steps)
                                        or (stopping and tc.checkpoint_every)):
                    _gather_params(s.models, tc)
                    _save(run, s, step + 1)
                if stopping:
                    if s.saves is not None:
                        s.last_good = s.saves.wait() or s.last_good
                    raise _stopped(run, stopping, step + 1, s.last_good)
            if s.saves is not None:
                s.last_good = s.saves.wait() or s.last_good
            _gather_params(s.models, tc)
            report = run.host.run_report(run.context(run.max_steps, parameters=s.parameters, note=s.note))
        finally:
            if s.log is not None:
                s.log.close()
    return {"steps": run.max_steps, "started_at_step": s.start, "last_checkpoint": str(s.last_good),
            "tokens_per_step": s.tokens_per_step, "first_step_done_at": s.first_step_done_at, "layout": s.layout,
            "plugin_report": report}


def _save(run: EngineRun, s: _Session, step: int) -> None:
    """Checkpoint ``step``: in the background (``s.saves``), or on the training thread."""
    manifest = {"record": run.record, "layout": s.layout}
    if s.saves is not None:
        s.saves.save(step, s.models, s.optimizer, manifest=manifest)
        return
    t0 = time.perf_counter()
    s.last_good = checkpoint.save_checkpoint(run.folder.checkpoints, step, s.models, s.optimizer,
                                             keep=run.train.keep_checkpoints, manifest=manifest)
    if s.log is not None:
        s.log.note(f"checkpoint {s.last_good}: training paused {time.perf_counter() - t0:.1f} s (written on the "
                   "training thread)", echo=False)


def evaluate(run: EngineRun, s: _Session) -> dict:
    """``{"val_loss": ...}`` on every rank: one forward-only pass through the schedule over this rank's share of
    the held-out rows (nam_core/engine/validation.py), no gradients, the chunks in eval mode for the pass (as
    Megatron's own ``evaluate``). What the pass leaves in the blocks' aux-loss sums and in Megatron's MoE
    metrics tracker is dropped: it is not the training step's. Collective (every rank)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tc, held = run.train, run.held_out
    if held is None:
        raise ConfigError(f"train.eval_every={tc.eval_every} and no held-out rows were given to the engine",
                          hint="nam train gives them (--eval-data DIR, or a dataset with a validation split)")
    n = held.micro_batches(eval_tokens=tc.eval_tokens, micro_batch_size=tc.micro_batch_size, dp=s.dp)

    def batches():
        for j in range(n):
            index = held.rank_batch(j, dp=s.dp, dp_rank=s.dp_rank, micro_batches=n)
            yield index, {k: v.to(parallel.device(), non_blocking=True)
                          for k, v in held.batch_at(index, tc.micro_batch_size).items()}

    for model in s.models:
        model.eval()
    try:
        with torch.no_grad():
            losses = s.schedule(forward_step_func=run.model.forward_step, model=s.models, data_iterator=batches(),
                                num_microbatches=n, seq_length=run.model.seq_len,
                                micro_batch_size=tc.micro_batch_size, forward_only=True)
    finally:
        for model in s.models:
            model.train()
            run.model.end_step(unwrap(model))
        get_moe_metrics_tracker().clear()
    # Pipeline stages without the loss hold no entries; tensor-parallel copies of one count alike (a ratio).
    sums = torch.zeros(2, dtype=torch.float64, device=parallel.device())
    if losses:
        sums[0] = torch.stack([m["lm_loss"].double().reshape(()) for m in losses]).sum()
        sums[1] = len(losses)
    torch.distributed.all_reduce(sums)
    return {"val_loss": mean_loss(*sums.tolist())}


def _start(run: EngineRun, patch_reports: list) -> _Session:
    """Checks, process groups, the model chunks, the optimizer, the resume and rank 0's log."""
    provider, tc = run.model, run.train
    par = dict(provider.parallel)
    if par != {"tp": tc.tp, "pp": tc.pp, "ep": tc.ep}:
        raise ConfigError(f"the model was lowered for {par}, the train config says tp={tc.tp} pp={tc.pp} ep={tc.ep}",
                          hint="lower the model with the run's train.tp/pp/ep")
    world = int(os.environ["WORLD_SIZE"])
    dp = checks.check_layout(world_size=world, **par, train=tc, registered_schedules=run.schedules)
    provider.check(registered_schedules=run.schedules)
    schedule = schedule_for(tc.schedule, pp=par["pp"], registered=run.schedules)
    if schedule.chunks_per_rank != provider.chunks:
        raise ConfigError(f"train.schedule={tc.schedule!r} runs {schedule.chunks_per_rank} model chunk(s) per "
                          f"pipeline rank, the model was lowered for {provider.chunks}",
                          hint=f"lower the model with the run's schedule ({tc.schedule!r})")
    pg = parallel.init_parallel(**par, seed=tc.seed, schedule=schedule)
    chunks = schedule.chunks_per_rank
    layout = {"world_size": world, **par, **({"chunks": chunks} if chunks > 1 else {})}
    config, models = build_ddp(provider, tc, pg, distributed_optimizer=True, schedule=schedule,
                               transform=lambda chunk: run.notes.extend(run.host.transform_model(chunk, run.spec)))
    for model in models:
        model.broadcast_params()
    opt = optimizer.build_optimizer(models, tc, config)
    optimizer.wire(config, models, opt, schedule)
    start, loading, load_peak, phases, load_notes = 0, 0.0, "", {}, []
    if run.resume_from is not None:
        loading = time.perf_counter()
        with _load_peak() as peak:
            start = checkpoint.load_checkpoint(run.resume_from, models, opt, layout=layout, phases=phases,
                                               notes=load_notes, train=tc)["step"]
        loading = time.perf_counter() - loading
        load_peak = f", peak GPU memory {peak['gib']:.1f} GiB" if peak else ""
        load_peak += "; " + ", ".join(f"{k} {phases[k]:.1f}" for k in checkpoint.LOAD_PHASES if k in phases) + " s"
    elif run.optimizer_from is not None:
        start = optimizer.fill_state(opt, models, lambda chunk, tensors: provider.rank_tensors(chunk, tensors, pg),
                                     run.optimizer_from)
    log = None
    if torch.distributed.get_rank() == 0:
        folder = run.folder
        cut = folder.truncate_metrics(start) if run.resume_from is not None else []
        log = folder.metrics_log(start_step=start, total_steps=run.max_steps, quiet=run.quiet)
        resumed = ([f"resumed from {run.resume_from} at step {start} (loaded in {loading:.1f} s{load_peak})"]
                   if run.resume_from is not None else [])
        lane = [f"patch {r.name}: {r.state} ({r.detail})" for r in patch_reports if r.state == "applied"]
        for line in [*resumed, *load_notes, *cut, *run.notes, *lane, _overlaps(config, models[0].ddp_config),
                     optimizer.describe(tc)]:
            log.note(line)
        run.notes.clear()
    good = checkpoint.good_checkpoints(run.folder.checkpoints)
    tokens = dp * tc.grad_accum * tc.micro_batch_size * provider.seq_len
    saves = (checkpoint.BackgroundSaves(run.folder.checkpoints, keep=tc.keep_checkpoints,
                                        note=lambda line: log is not None and log.note(line, echo=False))
             if run.checkpoints and tc.async_checkpoints else None)
    return _Session(schedule, models, opt, layout, dp, pg.dp.rank(), start, good[-1] if good else None, tokens, log,
                    saves=saves)


@contextlib.contextmanager
def _load_peak():
    """For the ``with`` block around a checkpoint's load, on CUDA only: the dict it yields gets ``"gib"``, the most
    memory the caching allocator held for tensors during the block (``torch.cuda.max_memory_allocated``, GiB), the
    largest over the ranks (collective); the peak counter is reset on the way in and again on the way out, so the
    first step's ``mem_gib`` is its own. On another device the dict stays empty."""
    cuda = parallel.device().type == "cuda"
    peak: dict = {}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    yield peak
    if cuda:
        torch.cuda.synchronize()
        gib = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=parallel.device())
        torch.distributed.all_reduce(gib, op=torch.distributed.ReduceOp.MAX)
        peak["gib"] = float(gib)
        torch.cuda.reset_peak_memory_stats()


def _overlaps(config, ddp_config) -> str:
    """The log line naming the communication Megatron overlaps in this run and its gradient buffers' dtype, as
    Megatron's configs hold them."""
    on = [name for name, value in (("grad reduce", ddp_config.overlap_grad_reduce),
                                   ("param gather", ddp_config.overlap_param_gather),
                                   ("shared expert", getattr(config, "moe_shared_expert_overlap", False))) if value]
    grads = "fp32" if ddp_config.grad_reduce_in_fp32 else "the parameters' dtype"
    return f"overlap: {', '.join(on) or 'none'} (train.overlap_grad_reduce, overlap_param_gather, " \
           f"moe_shared_expert_overlap); gradient buffers in {grads} (train.grad_reduce_in_fp32)"


def _gather_params(models: list, train: TrainConfig) -> None:
    """With ``train.overlap_param_gather`` the optimizer step leaves the other ranks' shards of the updated
    weights to the next forward pass (bucket by bucket, in its pre-hooks); a checkpoint, and the caller after the
    run, need them now. Megatron's training loop does the same before it saves. Collective (every rank)."""
    if train.overlap_param_gather:
        for model in models:
            model.start_param_sync(force_sync=True)


def _batches(run: EngineRun, step: int, dp_rank: int, dp: int):
    n, mbs = run.train.grad_accum, run.train.micro_batch_size
    device = parallel.device()
    for j in range(n):
        index = (step * dp + dp_rank) * n + j
        yield index, {k: v.to(device, non_blocking=True) for k, v in run.batch_at(index, mbs).items()}


def _step_means(run: EngineRun, s: _Session, losses: list[dict]) -> tuple[dict[str, float], list[str]]:
    """Per-step means over micro-batches and data-parallel replicas, summed over pipeline stages: the same
    numbers the local engine logs; and the chunks' log lines. Collective (every rank)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    sums: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    for micro in losses:
        for key, value in micro.items():
            sums[key] = sums.get(key, 0) + value.float()
    for model in s.models:
        chunk_aux, chunk_notes = run.model.end_step(unwrap(model))
        notes += chunk_notes
        for name, value in chunk_aux.items():
            sums[name] = sums.get(name, 0) + value
    tracker = get_moe_metrics_tracker()
    entry = tracker.metrics.get("load_balancing_loss")  # per layer: aux / coeff, summed over micro-batches
    if entry is not None:
        sums["moe_aux"] = entry.values.float().sum() * run.model.moe_aux_loss_coeff
    tracker.clear()
    names: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(names, sorted(sums))
    keys = sorted(set().union(*names))
    vector = torch.stack([torch.as_tensor(sums.get(k, 0.0), dtype=torch.float32, device=parallel.device())
                          .reshape(()) for k in keys])
    torch.distributed.all_reduce(vector)
    means = dict(zip(keys, (vector / (run.train.grad_accum * s.dp)).tolist()))
    means["loss"] = sum(means.values())
    return means, notes


def _peaks(t0: float) -> tuple[float, float]:
    """The step's wall time and peak memory (GiB), the largest over the ranks."""
    torch.cuda.synchronize()
    peaks = torch.tensor([time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 2**30],
                         device=parallel.device())
    torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    dt, mem = peaks.tolist()
    return dt, mem


def _guard(step: int, update_ok: bool, loss: float, grad_norm: float, s: _Session) -> None:
    """Stop on a non-finite loss or gradient norm, naming the first non-finite parameter."""
    if update_ok and math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    if s.saves is not None:  # a save in flight is of a good step: finished, it is the one to resume from
        s.last_good = s.saves.wait() or s.last_good
    raise TrainingGuardError(
        f"non-finite {what} at step {step} (rank {torch.distributed.get_rank()}: first non-finite is "
        f"{_first_non_finite(s.models)}); the optimizer already applied this step, so nothing "
        f"after the last good checkpoint is kept: {s.last_good or 'none'}",
        hint=f"resume from it with a lower lr: --resume {s.last_good or 'auto'} --set train.lr=...")


def _log(run: EngineRun, s: _Session, step: int, metrics: dict, notes: list[str]) -> None:
    """Rank 0: each distinct block message once per run (as the local engine), the metrics line."""
    if s.log is None:
        return
    for line in dict.fromkeys([*notes, *run.notes]):
        if line not in s.noted:
            s.noted.add(line)
            s.log.note(line)
    run.notes.clear()
    if (step + 1) % run.train.log_every == 0 or step in (s.start, run.max_steps - 1) or "val_loss" in metrics:
        s.log.log(metrics)
    s.log.advance()


def _first_non_finite(models: list) -> str:
    for i, model in enumerate(models):
        found = first_non_finite(unwrap(model))
        if not found.startswith("none"):
            return found if len(models) == 1 else f"{found} in model chunk {i}"
    return found  # every chunk finite: the "none (the loss itself is non-finite)" answer, without a rescan
