"""NAM56R's dense projections: the ``nn.Linear`` modules a linear swap (torchao's Float8Linear in
nam-plugin-float8, Transformer Engine's Linear in nam-plugin-te) may replace, found the same way for both.

A projection is chosen by the block that owns it and its attribute name, never by its path (the megatron
engine nests the same blocks under other names, ``...mixer.block.in_proj``)::

    Mamba3Mixer     in_proj, out_proj                      Mamba in/out projections
    MLA (DSA too)   wq_a, wq_b, wkv_a, wkv_b, wo           MLA/DSA projections (DSA subclasses MLA)
    MoE             shared.w_gate_up, shared.w_down        the shared expert
    MTPDepth        eh_proj, mlp.w_gate_up, mlp.w_down     the MTP projections

Not among them: the router (its softmax picks the experts), the DSA lightning indexer (its scores pick the
top-k keys), the n-gram embedding's projection, the embeddings and the LM head (the CE backend owns the head's
weight), the norms, and Mamba's fp32 per-head parameters. On the megatron engine the shared expert and the MTP
projections are Megatron's parallel linears, not ``nn.Linear``, so they are not found there.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


def _owners() -> dict[type, tuple[str, tuple[str, ...]]]:
    """Owner block class -> (its part, in the log line; its projections' attribute paths)."""
    from nam56r.blocks.mamba3 import Mamba3Mixer
    from nam56r.blocks.mla import MLA
    from nam56r.blocks.moe import MoE
    from nam56r.model import MTPDepth

    return {
        Mamba3Mixer: ("mamba", ("in_proj", "out_proj")),
        MLA: ("attention", ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")),
        MoE: ("shared expert", ("shared.w_gate_up", "shared.w_down")),
        MTPDepth: ("mtp", ("eh_proj", "mlp.w_gate_up", "mlp.w_down")),
    }


@dataclass(frozen=True)
class Projection:
    """One selected ``nn.Linear``: its path in the model, the module, and the part it belongs to."""

    name: str
    module: nn.Linear
    part: str

    def divisible_by(self, multiple: int) -> bool:
        return self.module.in_features % multiple == 0 and self.module.out_features % multiple == 0

    def describe(self) -> str:
        return f"{self.name} [{self.module.in_features} -> {self.module.out_features}]"


def dense_projections(model: nn.Module) -> list[Projection]:
    """The plain ``nn.Linear`` modules of the table above, in module order (a subclass, e.g. a linear a swap
    already replaced, is not selected again)."""
    owners = _owners()
    chosen: list[Projection] = []
    for path, block in model.named_modules():
        part, attrs = next(((p, a) for cls, (p, a) in owners.items() if isinstance(block, cls)), (None, ()))
        for attr in attrs:
            try:
                module = block.get_submodule(attr)
            except AttributeError:
                continue  # e.g. the megatron engine's MoE has no nam ``shared`` SwiGLU
            if type(module) is nn.Linear:
                chosen.append(Projection(f"{path}.{attr}" if path else attr, module, part))
    return chosen


def projections_of(cfg) -> list[Projection]:
    """``dense_projections`` of NAM56R built from ``cfg`` on the meta device (no memory; ~2 s at full size):
    what a plugin's shape row judges before a run."""
    from nam56r.model import build_model

    return dense_projections(build_model(cfg, device="meta"))


def misaligned(projections: list[Projection], multiple: int) -> list[Projection]:
    return [p for p in projections if not p.divisible_by(multiple)]


def shown(projections: list[Projection], most: int = 4) -> str:
    """The first ``most`` projections described, and how many more."""
    more = len(projections) - most
    return ", ".join(p.describe() for p in projections[:most]) + (f" and {more} more" if more > 0 else "")


def shape_row(cfg, multiple: int) -> tuple[bool, str]:
    """A shape row's verdict: every projection of ``cfg`` divisible by ``multiple`` in both dims, and what was
    found (the misaligned ones, or how many there are)."""
    chosen = projections_of(cfg)
    bad = misaligned(chosen, multiple)
    if bad:
        return False, f"{len(bad)} of {len(chosen)} are not: {shown(bad)}"
    return True, f"{len(chosen)} projections"


def refuse_misaligned(projections: list[Projection], multiple: int, who: str) -> None:
    """ValueError naming the projections whose dims are not divisible by ``multiple`` (``who``: the option that
    asked for the swap); a plugin's shape row refuses such a run before this is reached."""
    bad = misaligned(projections, multiple)
    if bad:
        raise ValueError(f"{who}: dims not divisible by {multiple}: "
                         + ", ".join(p.describe() for p in bad[:4]) + (" ..." if len(bad) > 4 else ""))


def count_by_part(projections: list[Projection]) -> str:
    """``"mamba 34, attention 75, ..."`` in module order, or ``"none found"``."""
    by_part: dict[str, int] = {}
    for p in projections:
        by_part[p.part] = by_part.get(p.part, 0) + 1
    return ", ".join(f"{part} {n}" for part, n in by_part.items()) or "none found"
