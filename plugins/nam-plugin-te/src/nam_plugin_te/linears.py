"""Which of NAM56R's ``nn.Linear`` modules become Transformer Engine linears, and the swap.

The projections are ``nam56r.projections``' (the block that owns each one and its attribute name): every
dense GEMM of NAM56R outside the experts and the heads, 159 at full size, the Mamba ones the widest (in_proj
4096 -> 24992); what is left in the run's dtype and class is listed there.

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

import torch
from torch import nn

from nam56r.projections import count_by_part, dense_projections, refuse_misaligned

MULTIPLE = 16
"""TE's FP8 GEMMs need both dims of the weight divisible by 16 (``assert_dim_for_fp8_exec``)."""


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
        refuse_misaligned(chosen, MULTIPLE, f"te.fp8={fp8}")
    recipe = None if fp8 == OFF else te_recipe(fp8)
    for p in chosen:
        parent_path, _, attr = p.name.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, te_linear_from(p.module, te, recipe))
    parts = count_by_part(chosen)
    how = "bf16" if fp8 == OFF else f"FP8 {fp8} scaling"
    return (f"te: {len(chosen)} nn.Linear -> Transformer Engine Linear ({how}): {parts}; router, indexer, n-gram "
            "projection, embeddings, LM head, norms and Mamba's fp32 parameters unchanged")


def te_modules(model: nn.Module) -> list[str]:
    """Paths of the swapped TE linears in ``model``."""
    return [n for n, m in model.named_modules() if type(m).__name__ == "NamTELinear"]
