"""NAM56R's layer-pattern notation, translated into a layer plan. Fail-closed: no symbol is ever remapped.

Symbols::

    M  Mamba-3 mixer layer          E  MoE layer
    A  full MLA attention layer     D  DSA attention layer (lightning indexer + sparse MLA)
    *  an attention slot, resolved to A or D by the placement rule (which attention ranks are MLA)
    R  the n-gram-hash head at the model entrance; only as the first character, never a stack layer

A *period* such as ``*EME*EME*EMM*`` ends with the ``*`` that starts the next period, so the repeating unit
is the period without its last character (12 layers). The stack tiles that unit to ``num_layers``:
52 = 4 x 12 + 4, giving 13 attention slots, of which ranks 0, 4, 8, 12 are MLA and the other 9 are DSA.
A pattern already of length ``num_layers`` and free of ``*`` is taken as written.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from nam_core.errors import ConfigError

KIND = {"M": "mamba", "E": "moe", "A": "mla", "D": "dsa"}
SLOT = "*"
NGRAM_HEAD = "R"


@dataclass(frozen=True)
class LayerSpec:
    index: int
    """Position in the stack, 0-based."""
    symbol: str
    """Resolved symbol: M, E, A or D."""
    attention_rank: int | None = None
    """Rank among attention layers (A and D), 0-based; None for M and E."""
    dsa_rank: int | None = None
    """Rank among DSA layers, 0-based; None for the others (IndexCache places Full/Shared by it)."""

    @property
    def kind(self) -> str:
        return KIND[self.symbol]


@dataclass(frozen=True)
class LayerPlan:
    layers: tuple[LayerSpec, ...]
    ngram_head: bool
    """True when the pattern starts with R (the n-gram-hash embedding is part of the model)."""

    @property
    def resolved(self) -> str:
        return "".join(layer.symbol for layer in self.layers)

    def counts(self) -> dict[str, int]:
        c = Counter(layer.kind for layer in self.layers)
        return {kind: c.get(kind, 0) for kind in ("mla", "dsa", "mamba", "moe")}


def _error(pattern: str, pos: int, what: str) -> ConfigError:
    pointer = f"\n  {pattern}\n  {' ' * pos}^"
    return ConfigError(
        f"layer pattern {pattern!r}, position {pos}: {what}{pointer}",
        hint="symbols: M (Mamba-3), E (MoE), A (MLA), D (DSA), * (attention slot), R (leading n-gram head)",
    )


def expand(pattern: str, num_layers: int) -> str:
    """Tile a period to ``num_layers`` symbols (unresolved ``*`` kept)."""
    body = pattern[1:] if pattern.startswith(NGRAM_HEAD) else pattern
    for pos, ch in enumerate(body):
        if ch == NGRAM_HEAD:
            raise _error(pattern, pos + (len(pattern) - len(body)), "R (the n-gram head) may only come first")
        if ch not in KIND and ch != SLOT:
            raise _error(pattern, pos + (len(pattern) - len(body)), f"unknown symbol {ch!r}")
    if not body:
        raise ConfigError(f"layer pattern {pattern!r} has no layers", hint="e.g. *EME*EME*EMM*")
    if len(body) == num_layers:
        return body
    # A period that ends with the slot that opens the next one repeats without that last slot.
    unit = body[:-1] if len(body) > 1 and body.endswith(SLOT) and body.startswith(SLOT) else body
    return (unit * (num_layers // len(unit) + 1))[:num_layers]


def resolve(pattern: str, num_layers: int, mla_attention_ranks: tuple[int, ...]) -> LayerPlan:
    """Resolve ``pattern`` into a plan of exactly ``num_layers`` layers."""
    if num_layers <= 0:
        raise ConfigError(f"num_layers must be positive, found {num_layers}", hint="e.g. --set num_layers=52")
    symbols = expand(pattern, num_layers)
    n_slots = symbols.count(SLOT)
    bad = [r for r in mla_attention_ranks if not 0 <= r < n_slots]
    if bad and n_slots:
        raise ConfigError(
            f"mla_attention_ranks {list(mla_attention_ranks)} name slots {bad}, but the pattern has "
            f"{n_slots} attention slots (ranks 0..{n_slots - 1})",
            hint="fix mla_attention_ranks or the pattern",
        )
    layers, attn, dsa = [], 0, 0
    for index, ch in enumerate(symbols):
        if ch == SLOT:
            ch = "A" if attn in mla_attention_ranks else "D"
        if ch in "AD":
            layers.append(LayerSpec(index, ch, attention_rank=attn, dsa_rank=dsa if ch == "D" else None))
            attn += 1
            dsa += ch == "D"
        else:
            layers.append(LayerSpec(index, ch))
    return LayerPlan(tuple(layers), ngram_head=pattern.startswith(NGRAM_HEAD))
