"""The patch-lane entry for Megatron-Core's HybridModel that NAM56R's build needs, applied for the build of one
model chunk (``NamMegatronModel.build``) and listed by ``nam patches``.

``megatron-hybrid-stage-choice``: HybridModel picks a chunk's `|` segment as ``vp_stage * pp + pp_rank`` (its
interleaved order, ``select_pipeline_segment``) and puts MTP on the last pipeline rank (``mtp_on_this_rank``),
with no argument to ask for another stage (§1.3). A schedule that lays out stages differently (two chunks per
rank folded into a V: stage ``2 pp - 1 - rank`` on chunk 1, MTP on rank 0; §7) needs the chunk built for the
stage it names. Fix: both functions consult the stage the builder chose (``chosen_stage``) and fall back to
Megatron's own choice outside it. ``HybridModel.__init__`` imports ``select_pipeline_segment`` from its module
at call time and ``mtp_on_this_rank`` at module import, so the fix swaps both names there.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect

from nam_core.patches import BUG_REPRODUCED, FIX_VALIDATED, Patch
from nam_core.registry import Entry

NAME = "megatron-hybrid-stage-choice"
OWNER = "nam56r"
_CHOSEN: contextvars.ContextVar = contextvars.ContextVar("nam_hybrid_stage", default=None)
"""(layer types, global offset of the first, MTP here) of the chunk being built, or None: Megatron's choice."""


def _modules():
    from megatron.core.models.hybrid import hybrid_layer_allocation as allocation
    from megatron.core.models.hybrid import hybrid_model

    return allocation, hybrid_model


@contextlib.contextmanager
def chosen_stage(layer_types: list[str], offset: int, *, mtp: bool):
    """While a chunk builds: Megatron's segment choice gives it ``layer_types`` at global ``offset``, and MTP
    exactly when ``mtp``. Needs the patch applied (``nam_core.patches.applied(lane())``)."""
    token = _CHOSEN.set((list(layer_types), offset, mtp))
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def _select(original):
    def select_pipeline_segment(*args, **kwargs):
        chosen = _CHOSEN.get()
        return original(*args, **kwargs) if chosen is None else (list(chosen[0]), chosen[1])

    return select_pipeline_segment


def _mtp(original):
    def mtp_on_this_rank(*args, **kwargs):
        chosen = _CHOSEN.get()
        return original(*args, **kwargs) if chosen is None else chosen[2]

    return mtp_on_this_rank


def _installed() -> bool:
    allocation, hybrid_model = _modules()
    return (getattr(allocation.select_pipeline_segment, "__nam_patch__", None) == NAME
            and getattr(hybrid_model.mtp_on_this_rank, "__nam_patch__", None) == NAME)


def apply() -> None:
    allocation, hybrid_model = _modules()
    for module, name, make in ((allocation, "select_pipeline_segment", _select),
                               (hybrid_model, "mtp_on_this_rank", _mtp)):
        original = getattr(module, name)
        if getattr(original, "__nam_patch__", None) != NAME:
            wrapper = make(original)
            wrapper.__nam_patch__, wrapper.__wrapped__ = NAME, original
            setattr(module, name, wrapper)


def revert() -> None:
    allocation, hybrid_model = _modules()
    for module, name in ((allocation, "select_pipeline_segment"), (hybrid_model, "mtp_on_this_rank")):
        current = getattr(module, name)
        if getattr(current, "__nam_patch__", None) == NAME:
            setattr(module, name, current.__wrapped__)


def detect() -> bool:
    """Megatron's segment choice takes no stage layout (no ``layout`` argument), and the fix is not in place."""
    allocation, _ = _modules()
    takes_layout = "layout" in inspect.signature(inspect.unwrap(allocation.select_pipeline_segment)).parameters
    return not takes_layout and not _installed()


def reproduce() -> str:
    """Unpatched, Megatron's segment choice has no argument that names the stage to build (its signature) and
    gives vp_stage 1 of pipeline rank 0 of 2 segment 2; the V's chunk 1 there is stage 3. Patched, the choice
    returns the stage the builder names (CPU: a stand-in pipeline group; no process group needed)."""
    allocation, _ = _modules()
    if not _installed():
        return BUG_REPRODUCED if detect() else FIX_VALIDATED
    group = type("Group", (), {"size": lambda self: 2, "rank": lambda self: 0})()
    with chosen_stage(["E"], 3, mtp=True):
        got = allocation.select_pipeline_segment("M|M|M|E", group, 1)
    return FIX_VALIDATED if got == (["E"], 3) else BUG_REPRODUCED


def make_patch() -> Patch:
    return Patch(NAME, "megatron-core", ">=0.19",
                 summary="HybridModel builds a chunk for stage vp_stage * pp + rank only, MTP on the last rank; a "
                         "schedule's own stage layout (a V) needs the chunk built for the stage it names",
                 retire_when="a megatron-core release whose select_pipeline_segment takes a pipeline layout "
                             "(detection reads its signature), e.g. with V-shaped schedules upstream "
                             "(Megatron-LM PR #5254)",
                 detect=detect, apply=apply, revert=revert, reproduce=reproduce)


def lane() -> list[Entry]:
    return [Entry(NAME, make_patch(), OWNER)]
