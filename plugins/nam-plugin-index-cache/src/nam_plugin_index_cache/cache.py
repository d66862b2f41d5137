"""IndexCache: Shared DSA layers reuse the top-k of the nearest earlier Full layer (kernels-and-math.md §4).

Adjacent DSA layers pick 70-100% of the same keys (Bai et al., arXiv 2603.12201), so only the **Full (F)**
layers run their lightning indexer; a **Shared (S)** layer attends over the exact ``[b, s, topk]`` tensor its
nearest earlier Full layer returned. The pattern holds one F/S letter per DSA layer (by ``dsa_rank``).
NAM56R's default puts Full layers at DSA ranks 0, 3, 6 of 9 (``FSSFSSFSS``): 6 of 9 indexers skipped.

Fail closed to Full. Every DSA layer keeps its own indexer module; a Shared layer skips it only when
``state.dsa_cache`` holds its source layer's selection *for this micro-batch and sequence layout*. Otherwise
(no state, no earlier Full layer in this state e.g. the first DSA layer of a pipeline stage, another
micro-batch, another layout or shape) it computes its own top-k and says so once per reason. A stale
selection is never reused. MTP layers always compute their own.

Cache keying and activation recompute. Every DSA layer records the selection it *used* under its own key
``(main|mtp, dsa_rank)``, with the micro-batch, the layout and whether it ran its own indexer. A Shared layer
reads the entry of its *pattern-defined* source rank, never "the latest Full entry": a recompute that
replays layer 1 after layers 3 and 6 ran still reads rank 0. During recompute (``state.recompute``) a layer
with a valid entry of its own returns that recorded tensor, so the selection is the original one even if a
kernel's scores are not bit-deterministic; a layer that ran its indexer recomputes its scores (the KL needs
their graph) but not its top-k. With a fresh state and ``recompute`` set, the whole forward replays from
identical inputs, so Full layers recompute identical selections and Shared layers reuse them.

Losses. A Full layer returns its index scores, so its own KL loss trains its indexer. A Shared layer returns
``index_scores=None``: it adds no indexer loss (§4: "Shared layers have no indexer loss"), and its own
indexer gets no gradient while the cache hits. The training-aware variant of §4 (a Full indexer distilled
against the mean attention of every layer it serves) is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nam56r.blocks.indexer import causal_topk
from nam56r.state import ForwardState

FULL, SHARED = "F", "S"
FULL_EVERY = 3
"""Default rule: Full at DSA ranks 0, 3, 6, ... (cppmega ``CPPMEGA_INDEX_CACHE_FULL_LAYERS=0,3,6``, §4)."""
OPTION_PATTERN = "index-cache.pattern"
"""The plugin option that sets the pattern (``--set index-cache.pattern=FSSFSSFSS``)."""
CACHE_KEY = "index-cache"
"""This strategy's slot in ``ForwardState.dsa_cache``."""


# --- the pattern ----------------------------------------------------------------------------------
def default_pattern(n_dsa: int) -> str:
    """Full every ``FULL_EVERY``-th DSA rank from 0: ``default_pattern(9) == "FSSFSSFSS"``."""
    return "".join(FULL if rank % FULL_EVERY == 0 else SHARED for rank in range(n_dsa))


def pattern_problem(pattern: str, n_dsa: int) -> str | None:
    """What is wrong with ``pattern`` for a model of ``n_dsa`` DSA layers, or None when it is valid."""
    bad = sorted({ch for ch in pattern if ch not in (FULL, SHARED)})
    if bad:
        return f"letters {bad} (only F and S)"
    if len(pattern) != n_dsa:
        return f"{len(pattern)} letters for a model of {n_dsa} DSA layers"
    if pattern and pattern[0] != FULL:
        return "a first letter S: the first DSA layer has no earlier Full layer to reuse"
    return None


def saved_fraction(pattern: str) -> float:
    """Share of indexer work skipped: Shared layers / DSA layers (every DSA layer's indexer costs the same).

    The work is the indexer's scores and top-k in forward, its backward and its KL loss.
    ``saved_fraction("FSSFSSFSS") == 6 / 9``.
    """
    return pattern.count(SHARED) / len(pattern) if pattern else 0.0


def source_rank(pattern: str, rank: int) -> int | None:
    """The nearest Full rank at or before ``rank`` (``rank`` itself when Full); None when there is none."""
    for r in range(min(rank, len(pattern) - 1), -1, -1):
        if pattern[r] == FULL:
            return r
    return None


# --- the cache ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """The selection one DSA layer used in one forward state."""

    micro_batch: int
    seq_layout: tuple
    indices: torch.Tensor
    """``[b, s, topk]`` int64: the causal-masked top-k exactly as the layer returned it."""
    computed: bool
    """True when the layer ran its own indexer (a Full layer, or a Shared layer that missed)."""


def _key(layer: nn.Module, rank: int) -> tuple[str, int]:
    return ("mtp" if layer.is_mtp else "main", rank)


class IndexCache:
    """Indexer strategy ``index-cache``. ``IndexCache()`` uses the default rule (Full every third DSA rank).

    The engine builds it with ``IndexCache.build(ctx)``, which reads the ``index-cache.pattern`` option (parsed
    by the host, its pattern checked by the plugin's config check).
    """

    name = "index-cache"

    def __init__(self, pattern: str | None = None):
        self.pattern = pattern
        """F/S per DSA rank; None: the default rule (Full every ``FULL_EVERY``-th rank)."""
        self._logged: set[str] = set()
        self.notes: list[str] = []
        """Miss messages not yet shown by the engine hook (``nam_after_step`` drains them)."""
        self.announced = False
        """Set by ``nam_after_step`` once it has logged the pattern and the work it saves (after the first step
        in which a DSA layer asked this strategy for its top-k: a warm-up that wraps it may hold them dense)."""
        self.reused = 0
        """Top-k selections a Shared layer took from its Full layer (forward passes, recompute replays aside)."""
        self.computed = 0
        """Top-k selections a layer computed with its own indexer (Full layers, MTP layers, misses)."""
        self.first_step: int | None = None
        """The first optimizer step in which this strategy selected (set by ``nam_after_step``)."""

    @classmethod
    def build(cls, ctx) -> "IndexCache":
        """From the run's parsed options (``nam56r.backends.BackendContext``): ``index-cache.pattern`` or the
        default rule (no entry: built without a run)."""
        options = ctx.options.get(CACHE_KEY)
        raw = options.pattern if options is not None else None
        return cls(None if raw is None else raw.strip())

    @property
    def selections(self) -> int:
        return self.reused + self.computed

    def pattern_for(self, n_dsa: int) -> str:
        return self.pattern if self.pattern is not None else default_pattern(n_dsa)

    def is_full(self, rank: int) -> bool:
        """Ranks past the end of an explicit pattern are Full (fail closed)."""
        if self.pattern is None:
            return rank % FULL_EVERY == 0
        return rank >= len(self.pattern) or self.pattern[rank] == FULL

    def _source(self, rank: int) -> int | None:
        if self.pattern is None:
            return rank - rank % FULL_EVERY
        return source_rank(self.pattern, rank)

    # --- the strategy -----------------------------------------------------------------------------
    def select(
        self, layer: nn.Module, x: torch.Tensor, qr: torch.Tensor, state: ForwardState | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x [b, s, hidden]``, ``qr [b, s, q_lora]`` (detached) -> ``indices [b, s, k]``, scores or None."""
        rank = layer.dsa_rank
        if state is None:
            if not (layer.is_mtp or self.is_full(rank)):
                self._log(None, "no-state", f"Shared DSA layer {rank} computed its own top-k: no ForwardState")
            self.computed += 1
            return self._compute(layer, x, qr)
        cache = state.dsa_cache.setdefault(CACHE_KEY, {})
        if state.recompute:
            own = cache.get(_key(layer, rank))
            if self._miss(own, state, x, layer) is None:
                # Replay: the recorded selection, whatever the scores come out as this time.
                return own.indices, (layer.indexer(x, qr) if own.computed else None)
        if not (layer.is_mtp or self.is_full(rank)):
            src = self._source(rank)
            entry = cache.get(("main", src)) if src is not None else None
            miss = self._miss(entry, state, x, layer)
            if miss is None:
                cache[_key(layer, rank)] = Entry(state.micro_batch, state.seq_layout, entry.indices, False)
                self.reused += 1
                return entry.indices, None  # no indexer loss for a Shared layer (§4)
            reason, detail = miss
            self._log(state, reason, f"Shared DSA layer {rank} computed its own top-k: {detail}")
        indices, scores = self._compute(layer, x, qr)
        cache[_key(layer, rank)] = Entry(state.micro_batch, state.seq_layout, indices, True)
        self.computed += 1
        return indices, scores

    @staticmethod
    def _compute(layer: nn.Module, x: torch.Tensor, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = layer.indexer(x, qr)  # [b, s, s] fp32, causal-masked
        return causal_topk(scores, layer.cfg.index_topk), scores

    @staticmethod
    def _miss(entry: Entry | None, state: ForwardState, x: torch.Tensor, layer: nn.Module) -> tuple[str, str] | None:
        """Why ``entry`` may not be used for this layer now, as (reason key, detail); None when it may."""
        if entry is None:
            return ("no-full-entry", "no earlier Full layer recorded a selection in this forward state "
                    "(the first DSA layer of a pipeline stage, or a pattern starting with S)")
        if entry.micro_batch != state.micro_batch:
            return ("micro-batch", f"the cached selection is from micro-batch {entry.micro_batch}, "
                    f"this is micro-batch {state.micro_batch}")
        b, s = x.shape[:2]
        want = (b, s, min(layer.cfg.index_topk, s))  # shapes are host metadata: no device sync
        if entry.seq_layout != state.seq_layout or tuple(entry.indices.shape) != want:
            return ("layout", f"the cached selection has layout {entry.seq_layout} and shape "
                    f"{tuple(entry.indices.shape)}, this layer has {state.seq_layout} and needs {want}")
        return None

    def _log(self, state: ForwardState | None, reason: str, detail: str) -> None:
        """Say it once per reason for this strategy object: in ``state.log`` and for the engine hook."""
        if reason in self._logged:
            return
        self._logged.add(reason)
        message = f"index-cache: {detail} (logged once per reason)"
        self.notes.append(message)
        if state is not None:
            state.log.append(message)
