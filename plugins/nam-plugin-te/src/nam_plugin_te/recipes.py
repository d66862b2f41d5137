"""TE's FP8 recipes as ``te.fp8`` names them, what each needs, and the same choice in Megatron's config terms.

Light on purpose (no torch, no Transformer Engine at import): ``plugin.py`` reads the table to write its rows.
Every recipe uses TE's HYBRID format where it has a choice (e4m3 for activations and weights in forward, e5m2
for the gradients in backward: the format TE and Megatron default to for training).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FP8Recipe:
    name: str
    """``te.fp8`` value."""
    te_class: str
    """Class in ``transformer_engine.common.recipe``."""
    megatron: str
    """``TransformerConfig.fp8_recipe`` value (Megatron's ``Fp8Recipe``)."""
    scales: str
    """What the scales cover, in words (the option's doc and the log line)."""
    capability: tuple[int, int] = (9, 0)
    """Lowest CUDA capability TE runs it on."""
    cuda: tuple[int, int] | None = None
    """Lowest CUDA version (torch's build) TE runs it with; None: any TE supports."""


RECIPES = {r.name: r for r in (
    FP8Recipe("delayed", "DelayedScaling", "delayed", "one scale per tensor from the amax history of earlier "
              "steps (TE's default history of 1024 steps, max)"),
    FP8Recipe("current", "Float8CurrentScaling", "tensorwise", "one scale per tensor from the tensor's own amax"),
    FP8Recipe("blockwise", "Float8BlockScaling", "blockwise", "one scale per 1x128 block of activations and "
              "gradients and per 128x128 block of weights (e4m3 throughout)", cuda=(12, 9)),
    FP8Recipe("mxfp8", "MXFP8BlockScaling", "mxfp8", "one power-of-two scale per 32 elements (MXFP8)",
              capability=(10, 0)),
)}
"""``te.fp8`` recipe name -> its description. ``off`` (bf16 TE linears) is the option's default and no recipe."""
OFF = "off"
CHOICES = (OFF, *RECIPES)


def te_recipe(name: str):
    """The Transformer Engine recipe object for ``name`` (imports TE)."""
    from transformer_engine.common import recipe as te_recipes

    r = RECIPES.get(name)
    if r is None:
        raise ValueError(f"te.fp8={name!r}: expected one of {', '.join(RECIPES)} (or {OFF})")
    cls = getattr(te_recipes, r.te_class)
    if name in ("delayed", "current"):
        return cls(fp8_format=te_recipes.Format.HYBRID)
    return cls()


def cuda_at_least(found: str | None, needed: tuple[int, int]) -> bool:
    """``found`` (torch.version.cuda, "12.9"/"13.0") is at least ``needed``; False when unknown."""
    if not found:
        return False
    try:
        return tuple(int(x) for x in found.split(".")[:2]) >= needed
    except ValueError:
        return False
