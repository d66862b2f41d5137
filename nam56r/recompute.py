"""Activation recompute by block kind: keep a block's input, drop what its forward saved for backward, and run
the forward again inside backward (``train.recompute``, nam_core/engine/config.py).

Both engines run it on nam's blocks:

* the local engine: ``apply(model, kinds)`` marks each ``Layer``; a marked layer runs its mixer (``mamba``,
  ``moe``, ``attention``) or its whole body (``layer``: norm + mixer) under ``checkpointed``; ``mamba-scan``
  marks the Mamba-3 mixer itself, which runs the part past its in_proj under ``checkpointed``;
* the megatron engine: Megatron's own recompute where it has one for the block (``layer``: its full
  recompute of every layer; ``moe``: its selective ``moe`` module, which recomputes the MoE layer), and
  ``checkpointed`` in nam's slot adapters elsewhere (``mamba``, ``mamba-scan``, ``attention``: nam's blocks,
  which Megatron's selective modules do not reach; ``nam56r.megatron.lowering``).

``checkpointed`` is ``torch.utils.checkpoint`` non-reentrant with the RNG state preserved, so the replay sees
the same random numbers and the same inputs; the blocks are deterministic functions of those (the Mamba-3
scan, MoE's routing: the top-k of the same logits), which makes loss and gradients bit-exact against no
recompute (tests/test_recompute.py). Megatron's own recompute is its reentrant checkpoint, which adds the
replayed region's input gradient to the rest in another order: within 2e-7 relative of no recompute
(tests/test_megatron_engine_gloo.py). The replay runs with ``ForwardState.recompute`` set, so DSA's indexer
strategies return the selection the first pass made (nam56r/backends.py), and its side effects on the state
(aux losses, log lines) are dropped: the first pass already recorded them.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from nam56r.state import ForwardState

KIND_OF_LAYER = {"mamba": "mamba", "moe": "moe", "mla": "attention", "dsa": "attention"}
"""A layer's kind (``LayerSpec.kind``) -> the recompute kind that covers its mixer."""


_CHECKPOINTED: ContextVar[bool] = ContextVar("nam_checkpointed", default=False)


def inside_checkpointed() -> bool:
    """Whether this code runs in the body of ``checkpointed`` (its first pass or its replay): what a forward
    saves for backward here is dropped at once and rebuilt by the replay inside backward, so saving a tensor
    costs memory only from the replay to that op's backward. A backend may then save what it would otherwise
    compute again in its backward (nam-plugin-mimo-scan's chunk states). Both passes answer alike, as torch's
    checkpoint wants: it matches the tensors the replay saves to the first pass's, one for one. Megatron's own
    (reentrant) recompute is not ``checkpointed``: False there."""
    return _CHECKPOINTED.get()


def checkpointed(fn: Callable[..., torch.Tensor], state: ForwardState | None, *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args, state)``, its activations recomputed in backward (see the module docstring)."""
    passes = []

    def body(*inputs):
        passes.append(None)
        token = _CHECKPOINTED.set(True)
        try:
            if len(passes) == 1 or state is None:
                return fn(*inputs, state)
            with replaying(state):
                return fn(*inputs, state)
        finally:
            _CHECKPOINTED.reset(token)

    return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True)


@contextmanager
def replaying(state: ForwardState) -> Iterator[None]:
    """A recompute pass over ``state``: ``state.recompute`` set, and the aux losses and log lines it adds
    dropped afterwards (also when torch stops the replay early, once every tensor backward needs is back)."""
    losses = {name: list(values) for name, values in state.aux_losses.items()}
    logged, was = len(state.log), state.recompute
    state.recompute = True
    try:
        yield
    finally:
        state.recompute = was
        state.aux_losses = losses
        del state.log[logged:]


def apply(model: torch.nn.Module, kinds: Iterable[str]) -> list[str]:
    """Mark the layers of ``model`` (NAM56R's main stack and its MTP depths) whose kind ``kinds`` names; returns
    one line per marked kind for the run log. ``layer`` marks every layer whole. A layer is a module with a
    layer ``spec`` and a ``recompute`` slot (``nam56r.model.Layer``; not imported: the model imports this)."""
    kinds = frozenset(kinds)
    counts: dict[str, int] = {}
    for module in model.modules():
        if not (hasattr(module, "recompute") and hasattr(getattr(module, "spec", None), "kind")):
            continue
        kind = "layer" if "layer" in kinds else KIND_OF_LAYER[module.spec.kind]
        module.recompute = kind if kind in kinds else None
        scan = mark_scan(module.mixer, kinds if module.recompute is None else ())  # a recomputed mixer: whole
        if module.recompute is not None or scan:
            kind = module.recompute or "mamba-scan"
            counts[kind] = counts.get(kind, 0) + 1
    return [f"activation recompute: {kind} in {n} layers (train.recompute)" for kind, n in sorted(counts.items())]


def mark_scan(mixer: torch.nn.Module, kinds: Iterable[str]) -> bool:
    """Set a Mamba-3 mixer's ``recompute_scan`` to whether ``kinds`` names ``mamba-scan`` (the part past its
    in_proj: ``nam56r.blocks.mamba3``); False for any other block. Both engines' Mamba mixers go through here."""
    if not hasattr(mixer, "recompute_scan"):
        return False
    mixer.recompute_scan = "mamba-scan" in kinds
    return mixer.recompute_scan
