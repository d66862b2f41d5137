"""One contract for every engine: the run context both take (``EngineRun``) and what an engine does
(``Engine``: start, checkpoints, resume, train, finish). The composition root (``nam56r.run.build``) makes the
``EngineRun``; the CLI, the benches and the tests hand it to ``engine_for(name).train``. No engine imports
another; what they share lives here, in ``step.py`` (lr, metrics record, non-finite search) and in
``rundir.py`` (the run folder).

torchtitan's trainer and ``TrainSpec`` are the model: the engine owns the loop, the model package owns what is
trained.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from nam_core.engine.config import ENGINES, TrainConfig
from nam_core.engine.rundir import RunFolder
from nam_core.errors import ConfigError
from nam_core.run import RunSpec, StepContext


@dataclass
class EngineRun:
    """Everything one training run needs, for either engine.

    ``model`` is what the engine trains: for the local engine a ``nam_core.engine.local.LocalModel`` (a module
    and its forward), for the megatron engine a ``nam_core.engine.megatron.MegatronModel`` (a provider that
    builds the chunks on each rank). ``batch_at(index, batch_size)`` returns micro-batch ``index`` (a dict of
    [b, s] CPU tensors, the keys the model reads) as a pure function of the index: the data order of a resumed
    run is the uninterrupted one's.
    """

    run_dir: Path
    spec: RunSpec
    """The run the plugins were activated for; lifecycle hooks read it through their ``StepContext``."""
    model: Any
    batch_at: Callable[[int, int], dict]
    host: Any
    """The lifecycle hooks: ``transform_model``, ``before_step``, ``after_step`` (a ``PluginHost``)."""
    max_steps: int
    flops_per_token: float
    backends: Mapping[str, Any] = field(default_factory=dict)
    """Kind -> the backend object the model runs (``StepContext.backend``)."""
    schedules: Mapping[str, Any] = field(default_factory=dict)
    """The ``schedules`` registry (name -> implementation); the megatron engine picks ``train.schedule`` in it."""
    record: dict = field(default_factory=dict)
    """The run's identity (config, plugins, data), stored in every checkpoint manifest."""
    resume_from: Path | None = None
    quiet: bool = False
    notes: list[str] = field(default_factory=list)
    """Lines for the run log, each logged once (the fields requested plugins selected, blocks' messages)."""
    again: Callable[..., str] | None = None
    """``again(resume="auto", sets={"train.lr": "3e-05"})``: the command that continues this run, for the
    hints of a stop or a guard (the CLI knows the options it was started with)."""
    checkpoints: bool = True
    """False: write none, not even at the end (throughput benchmarks, whose state nobody resumes)."""
    held_out: Any = None
    """Validation rows (``nam_core.engine.validation.HeldOut``, ``train.eval_every``); None: no evaluation."""
    optimizer_from: Any = None
    """A run started from another's weights and AdamW state (``nam train --init-from`` an export made with
    ``--with-optimizer``: ``nam56r.export.ExportedOptimizer``, by the model's parameter names): the engine fills
    its optimizer with it and starts at its ``step``. None: a fresh optimizer at step 0 (or ``resume_from``'s)."""

    @property
    def train(self) -> TrainConfig:
        return self.spec.train

    @property
    def folder(self) -> RunFolder:
        """The run folder's files (the lock is the CLI's: an engine only writes metrics and checkpoints)."""
        return RunFolder(self.run_dir)

    def context(self, step: int, *, parameters: Callable, note: Callable[[str], None]) -> StepContext:
        """What the lifecycle hooks of step ``step`` receive (``parameters``: the engine's trainable ones by
        name; ``note``: its run log)."""
        return StepContext(step=step, spec=self.spec, backends=self.backends, parameters=parameters, note=note,
                           max_steps=self.max_steps)

    def continue_command(self, **changes) -> str:
        """The command that continues this run (with ``changes``), for hints."""
        if self.again is not None:
            return self.again(**changes)
        engine = "" if self.spec.engine == "local" else f" --engine {self.spec.engine}"
        return f"nam train{engine} --run-dir {self.run_dir} --resume auto (with this run's other options)"


class HookChain:
    """The lifecycle hooks of several hosts, in order (the plugins' host, then a benchmark's profiler)."""

    def __init__(self, *hosts):
        self.hosts = hosts

    def transform_model(self, model, spec) -> list[str]:
        return [line for host in self.hosts for line in host.transform_model(model, spec)]

    def before_step(self, step: int, ctx: StepContext) -> None:
        for host in self.hosts:
            host.before_step(step, ctx)

    def after_step(self, step: int, ctx: StepContext, metrics: dict) -> None:
        for host in self.hosts:
            host.after_step(step, ctx, metrics)

    def run_report(self, ctx: StepContext) -> list[str]:
        return [line for host in self.hosts for line in host.run_report(ctx)]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``world_size`` (the local engine: 0 of 1)."""

    rank: int = 0
    world_size: int = 1

    @property
    def writes(self) -> bool:
        """Rank 0 alone prepares data and writes the run folder's files."""
        return self.rank == 0


@runtime_checkable
class Engine(Protocol):
    """What ``nam train`` asks of an engine, in this order: ``start`` (before anything touches CUDA),
    ``check_ahead`` (a resume's hashing of the checkpoints begun on a background thread, this rank's part, not
    collective), ``good_checkpoints``/``resolve_resume`` (what a start finds in the run folder; every rank calls
    ``good_checkpoints`` the same number of times, so an engine may make it collective), ``barrier`` (between the
    ranks' data preparation and the run folder's), ``train``, ``finish`` (after success only)."""

    name: str

    def start(self, spec: RunSpec, *, dry_run: bool, relaunch: Callable[[int], None] | None = None) -> Ranks:
        """Start the engine for ``spec``; ``relaunch(n)`` replaces this process with ``n`` of them (torchrun)."""

    def check_ahead(self, ckpt_root: Path) -> None: ...

    def good_checkpoints(self, ckpt_root: Path) -> list[Path]: ...

    def resolve_resume(self, spec: str, ckpt_root: Path, *, warn: Callable[[str], None]) -> Path: ...

    def barrier(self) -> None: ...

    def train(self, run: EngineRun) -> dict: ...

    def finish(self) -> None: ...


_ENGINES = {"local": "nam_core.engine.local:LocalEngine", "megatron": "nam_core.engine.megatron:MegatronEngine"}


def engine_for(name: str) -> Engine:
    """The engine called ``name`` (its module imports only here, so a CPU machine never loads Megatron's)."""
    if name not in _ENGINES:
        raise ConfigError(f"--engine {name!r}: expected one of {', '.join(ENGINES)}", hint="--engine local")
    module, _, cls = _ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)()
