"""Per-forward state handed to every block: auxiliary losses and the DSA selection cache.

One ``ForwardState`` lives for exactly one forward pass of one micro-batch. Blocks add their auxiliary losses
(router balance, indexer KL) to it instead of returning tuples, and DSA indexer strategies keep cross-layer
data (IndexCache's top-k) in ``dsa_cache`` so nothing outlives the micro-batch it was computed for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardState:
    micro_batch: int = 0
    """Monotonic id of the micro-batch this forward belongs to (caches check it)."""
    seq_layout: tuple = ()
    """(batch, seq_len) plus anything that changes which keys a query may see; caches check it."""
    recompute: bool = False
    """True during an activation-recompute pass: strategies must reproduce the original selection."""
    aux_losses: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """name -> scalar losses, already multiplied by their coefficients."""
    dsa_cache: dict = field(default_factory=dict)
    """Free-form store for indexer strategies (cleared with the state)."""
    log: list[str] = field(default_factory=list)
    """Messages a block wants logged once by the engine (e.g. an IndexCache miss)."""

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        self.aux_losses.setdefault(name, []).append(value)

    def total_aux_loss(self) -> torch.Tensor | None:
        values = [v for vs in self.aux_losses.values() for v in vs]
        return torch.stack(values).sum() if values else None
