"""The typed run that hooks receive: ``RunSpec`` (what will run) and ``StepContext`` (one optimizer step).

A model package's composition root (``nam56r.run.resolve``) builds the ``RunSpec`` from a recipe, ``--set``
overrides, plugins, engine, layout and device; check hooks (``nam_check_config``, ``nam_preflight``) receive
it. Engines build a ``StepContext`` around every step for the lifecycle hooks (``nam_before_step``,
``nam_after_step``): a plugin asks the context for what it needs (the run, a backend, the trainable
parameters, the log), never walks an engine's attributes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, Mapping, TypeVar

from nam_core.engine.config import TrainConfig
from nam_core.options import OptionValues

if TYPE_CHECKING:
    import torch

    from nam_core.device import DeviceInfo

M = TypeVar("M")


@dataclass(frozen=True)
class Layout:
    """How the run spreads over processes: parallel sizes and the process count."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1
    """Processes of the run (``--nproc``, or torchrun's WORLD_SIZE); 1 on the local engine."""
    nproc: int | None = None
    """``--nproc`` as given: the run starts torchrun itself with this many processes."""

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


@dataclass(frozen=True)
class RunSpec(Generic[M]):
    """A resolved, checked run: what ``nam train`` would run and ``nam preflight`` judges."""

    recipe: str
    model: M
    """The model's config (nam56r: ``NAM56RConfig``)."""
    train: TrainConfig
    engine: str
    """``local`` or ``megatron``."""
    layout: Layout
    plugins: tuple[str, ...]
    """Requested plugins, in order (built-in ones included)."""
    backends: Mapping[str, str]
    """Kind -> the implementation name the run asks for (``{"ssm": "reference", ...}``), for every kind the
    run picks by a config field, engine-owned names (``train.schedule=single``) left out."""
    options: Mapping[str, OptionValues] = field(default_factory=dict)
    """Plugin -> its parsed options (every declared option, typed, defaults filled)."""
    device: DeviceInfo | None = None
    """The device the run trains on (probed, or a ``--device-profile`` fake); None until the engine has
    started (the megatron engine sets the allocator before anything touches CUDA)."""
    explicit: frozenset[str] = frozenset()
    """Model fields the user set by name (``--set``): a choice config checks may treat as deliberate."""
    notes: tuple[str, ...] = ()
    """How requested plugins changed the config (``PluginInfo.selects``); printed before a run starts."""
    wrapped: Mapping[str, str] = field(default_factory=dict)
    """Kind -> the implementation the selected one wraps (``PluginInfo.wraps``: ``{"indexer": "full"}``)."""

    def replace(self, **changes) -> "RunSpec[M]":
        return dataclasses.replace(self, **changes)

    def runs(self, kind: str, name: str) -> bool:
        """Whether the run uses implementation ``name`` of ``kind``: named by the kind's field, or wrapped by
        the one that field names (a warm-up strategy runs the one it wraps after its warm-up)."""
        return self.backends.get(kind) == name or self.wrapped.get(kind) == name


@dataclass
class StepContext:
    """What a lifecycle hook may read or do around optimizer step ``step`` (0-based). Engines build it."""

    step: int
    spec: RunSpec
    backends: Mapping[str, Any]
    """Kind -> the backend object the model runs (``ctx.backend("indexer")``)."""
    parameters: Callable[[], Iterator[tuple[str, "torch.nn.Parameter"]]]
    """The trainable parameters by name (``model.named_parameters``), for a hook that freezes some."""
    note: Callable[[str], None]
    """Add one line to the run log (printed and written to run.log), once per distinct line."""
    max_steps: int | None = None
    """The step this run stops at (``--max-steps``, else ``train.total_steps``); None outside a run."""

    def backend(self, kind: str) -> Any:
        """The backend object of ``kind`` (KeyError naming the kinds there are otherwise)."""
        try:
            return self.backends[kind]
        except KeyError:
            raise KeyError(f"no backend kind {kind!r} in this run; kinds: {', '.join(self.backends)}") from None

    def backends_of(self, kind: str) -> list[Any]:
        """The backend of ``kind`` and every backend it wraps (each wrapper exposes ``wrapped``), outermost first."""
        chain, obj = [], self.backend(kind)
        while obj is not None and obj not in chain:
            chain.append(obj)
            obj = getattr(obj, "wrapped", None)
        return chain

    def find(self, kind: str, cls: type) -> Any | None:
        """The backend of ``kind`` that is a ``cls``, looking through wrappers; None if the run has none."""
        return next((b for b in self.backends_of(kind) if isinstance(b, cls)), None)
