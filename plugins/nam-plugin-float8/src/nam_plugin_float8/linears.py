"""Which of NAM56R's ``nn.Linear`` modules run in FP8, and the swap (``torchao.float8``).

The projections are ``nam56r.projections``' (the block that owns each one and its attribute name); what
is left in the run's dtype is listed there. On the megatron engine the shared expert and the MTP projections
are Megatron's own ``ColumnParallelLinear`` / ``RowParallelLinear``: they stay bf16 there (the transform's
log line counts what it swapped).

``Float8Linear.from_float`` assigns the old module's ``weight`` Parameter to the new module, so the swap keeps
every parameter object, its name and its dtype: the optimizer, the checkpoint keys and Megatron's grad buffers
see the same parameters. MLA's absorbed path reads ``wkv_b.weight`` directly (nam56r/blocks/mla.py): that
product stays bf16 whichever class holds the weight.
"""

from __future__ import annotations

import torch
from torch import nn

from nam56r.projections import count_by_part, dense_projections, refuse_misaligned
from nam_plugin_float8.shapes import MULTIPLE

RECIPES = ("tensorwise", "rowwise")
"""``torchao.float8.Float8LinearRecipeName`` values offered: per-tensor scales (cuBLAS) and per-row scales
rounded to powers of two (CUTLASS), e4m3 for inputs, weights and gradients in both."""


def torchao_config(recipe: str):
    """``Float8LinearConfig.from_recipe_name(recipe)``."""
    from torchao.float8 import Float8LinearConfig

    if recipe not in RECIPES:
        raise ValueError(f"float8 linears recipe {recipe!r}: expected one of {', '.join(RECIPES)}")
    return Float8LinearConfig.from_recipe_name(recipe)


def convert(model: nn.Module, recipe: str) -> str:
    """Swap the selected projections of ``model`` for ``torchao.float8.Float8Linear`` (in place) and return the
    line that says what changed. Raises ValueError on a selected projection whose dims are not divisible by 16
    (``nam_check_config`` refuses such a run first)."""
    from torchao.float8 import convert_to_float8_training

    chosen = dense_projections(model)
    refuse_misaligned(chosen, MULTIPLE, "float8.linears")
    ids = {id(p.module) for p in chosen}
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: id(module) in ids,
                               config=torchao_config(recipe))
    parts = count_by_part(chosen)
    return (f"float8: {len(chosen)} nn.Linear -> torchao Float8Linear ({recipe}): {parts}; router, indexer, "
            f"n-gram projection, embeddings, LM head, norms and Mamba's fp32 parameters unchanged")


def float8_modules(model: nn.Module) -> list[str]:
    """Paths of the ``Float8Linear`` modules in ``model`` (what a conversion produced)."""
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def linear_error(recipe: str, *, tokens: int = 4096, d_in: int = 1024, d_out: int = 2048, device="cuda",
                 seed: int = 0) -> dict:
    """``||ours - ref|| / ||ref||`` of a ``Float8Linear`` (``recipe``, bf16 in and out) against ``nn.Linear`` in
    fp32 on the same bf16 values: the output and the input and weight gradients."""
    from torchao.float8.float8_linear import Float8Linear

    from nam_core.testing import rel_norm_error

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(d_out, d_in, generator=g) * d_in**-0.5).to(device, torch.bfloat16)
    dy = torch.randn(tokens, d_out, generator=g).to(device, torch.bfloat16)
    out = {}
    for which, dtype in (("ref", torch.float32), ("fp8", torch.bfloat16)):
        lin = nn.Linear(d_in, d_out, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w.to(dtype))
        if which == "fp8":
            lin = Float8Linear.from_float(lin, config=torchao_config(recipe))
        xi = x.to(dtype).requires_grad_()
        y = lin(xi)
        y.backward(dy.to(y.dtype))
        out[which] = (y.detach(), xi.grad, lin.weight.grad)
    return {name: rel_norm_error(a, r) for name, a, r in zip(("out", "dx", "dweight"), out["fp8"], out["ref"])}
