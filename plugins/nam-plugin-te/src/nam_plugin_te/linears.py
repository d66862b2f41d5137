"""Which of NAM56R's ``nn.Linear`` modules become Transformer Engine linears, and the swap.

A projection is chosen by the block that owns it and its attribute name, never by its path (the megatron
engine nests the same blocks under other names, ``...mixer.block.in_proj``)::

    Mamba3Mixer     in_proj, out_proj                      Mamba in/out projections
    MLA (DSA too)   wq_a, wq_b, wkv_a, wkv_b, wo           MLA/DSA projections (DSA subclasses MLA)
    MoE             shared.w_gate_up, shared.w_down        the shared expert
    MTPDepth        eh_proj, mlp.w_gate_up, mlp.w_down     the MTP projections

These are every dense GEMM of NAM56R outside the experts and the heads: 159 projections at full size, the
Mamba ones the widest (in_proj 4096 -> 24992). Left in the run's dtype and class: the router (its softmax picks
the experts), the DSA lightning indexer (its scores pick the top-k keys), the n-gram embedding's projection,
the embeddings and the LM head (the CE backend owns the head's weight and fuses its GEMM with the loss), the
norms, and Mamba's fp32 per-head parameters. On the megatron engine the shared expert and the MTP projections
are Megatron's parallel linears, not ``nn.Linear``, so this swap does not reach them there.

The swap keeps every parameter object: the ``te.Linear`` is built on the meta device and the old module's
``weight`` Parameter is put in its place, so the optimizer, the checkpoint keys and Megatron's grad buffers see
the same parameters under the same names (TE adds one ``_extra_state`` entry per module to ``state_dict``: its
FP8 scaling state). MLA's absorbed path reads ``wkv_b.weight`` directly: that product stays bf16.

FP8: each swapped module runs its own forward inside ``te.autocast`` with the run's recipe, rather than one
autocast around the model's forward. Activation recompute replays a block's forward inside backward, outside
any context the model's forward held; a per-module autocast makes the replay run the same FP8 GEMMs as the
first pass (with current or blockwise scaling bit for bit; with delayed scaling the replay reads the scales
the first pass just updated).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

MULTIPLE = 16
"""TE's FP8 GEMMs need both dims of the weight divisible by 16 (``assert_dim_for_fp8_exec``)."""


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

    @property
    def aligned(self) -> bool:
        return self.module.in_features % MULTIPLE == 0 and self.module.out_features % MULTIPLE == 0

    def describe(self) -> str:
        return f"{self.name} [{self.module.in_features} -> {self.module.out_features}]"


def dense_projections(model: nn.Module) -> list[Projection]:
    """The plain ``nn.Linear`` modules of the table above, in module order (a subclass, e.g. a TE linear
    already swapped, is not selected again)."""
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
    """``dense_projections`` of NAM56R built from ``cfg`` on the meta device (no memory): what the plugin's
    shape row judges before a run."""
    from nam56r.model import build_model

    return dense_projections(build_model(cfg, device="meta"))


def misaligned(projections: list[Projection]) -> list[Projection]:
    return [p for p in projections if not p.aligned]


def te_linear_class(te) -> type:
    """A ``te.Linear`` subclass (one per TE module ``te``) whose forward runs inside ``te.autocast`` with the
    recipe the swap gave it (``nam_recipe``), or plain (bf16) when that is None."""
    return _linear_class(te.Linear, te.autocast)


@functools.cache
def _linear_class(base: type, autocast) -> type:
    class NamTELinear(base):
        """``transformer_engine.pytorch.Linear`` holding a NAM56R projection's weight; FP8 inside its own
        autocast (module docstring: why per module)."""

        nam_recipe = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.nam_recipe is None:
                return super().forward(x)
            with autocast(enabled=True, recipe=self.nam_recipe):
                return super().forward(x)

    return NamTELinear


def te_linear_from(old: nn.Linear, te, recipe=None) -> nn.Module:
    """A TE linear computing ``old``'s function with ``old``'s own ``weight`` Parameter (the same object)."""
    if old.bias is not None:
        raise ValueError("te: NAM56R's projections have no bias; a biased nn.Linear is not a selected projection")
    new = te_linear_class(te)(old.in_features, old.out_features, bias=False, params_dtype=old.weight.dtype,
                              device="meta")
    new._parameters["weight"] = old.weight  # the Parameter object itself: optimizer, checkpoint and DDP keep it
    new.nam_recipe = recipe
    new.train(old.training)
    return new


def _te():
    import transformer_engine.pytorch as te

    return te


def convert(model: nn.Module, fp8: str, *, te=None) -> str:
    """Swap the selected projections of ``model`` for TE linears in place (``fp8``: ``off`` or a ``te.fp8``
    recipe name) and return the line that says what changed. ``te``: the ``transformer_engine.pytorch`` module
    (tests pass a stand-in). Raises ValueError on an FP8 run with a projection whose dims are not divisible by 16
    (the plugin's shape row refuses such a run first)."""
    from nam_plugin_te.recipes import OFF, te_recipe

    te = te if te is not None else _te()
    chosen = dense_projections(model)
    if fp8 != OFF:
        bad = misaligned(chosen)
        if bad:
            raise ValueError(f"te.fp8={fp8}: dims not divisible by {MULTIPLE}: "
                             + ", ".join(p.describe() for p in bad[:4]) + (" ..." if len(bad) > 4 else ""))
    recipe = None if fp8 == OFF else te_recipe(fp8)
    for p in chosen:
        parent_path, _, attr = p.name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, te_linear_from(p.module, te, recipe))
    by_part: dict[str, int] = {}
    for p in chosen:
        by_part[p.part] = by_part.get(p.part, 0) + 1
    parts = ", ".join(f"{part} {n}" for part, n in by_part.items()) or "none found"
    how = "bf16" if fp8 == OFF else f"FP8 {fp8} scaling"
    return (f"te: {len(chosen)} nn.Linear -> Transformer Engine Linear ({how}): {parts}; router, indexer, n-gram "
            "projection, embeddings, LM head, norms and Mamba's fp32 parameters unchanged")


def te_modules(model: nn.Module) -> list[str]:
    """Paths of the swapped TE linears in ``model``."""
    return [n for n, m in model.named_modules() if type(m).__name__ == "NamTELinear"]
