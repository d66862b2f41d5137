"""Which of NAM56R's ``nn.Linear`` modules run in FP8, and the swap (``torchao.float8``).

A projection is chosen by the block that owns it and its attribute name, never by its path: the megatron
engine nests the same blocks under other names (``...mixer.block.in_proj``)::

    Mamba3Mixer     in_proj, out_proj                      Mamba in/out projections
    MLA (DSA too)   wq_a, wq_b, wkv_a, wkv_b, wo           MLA/DSA projections (DSA subclasses MLA)
    MoE             shared.w_gate_up, shared.w_down        the shared expert
    MTPDepth        eh_proj, mlp.w_gate_up, mlp.w_down     the MTP projections

Left in the run's dtype: the router (its softmax picks the experts), the DSA lightning indexer (its scores
pick the top-k keys), the n-gram embedding's projection, the embeddings and the LM head (parameters the CE
backend owns, not ``nn.Linear``), the norms, and every parameter that is not one of these weights (Mamba's
``D``, ``dt_bias``, B/C biases and MIMO projections: fp32 or per-head tensors, never touched). On the
megatron engine the shared expert and the MTP projections are Megatron's own ``ColumnParallelLinear`` /
``RowParallelLinear``, not ``nn.Linear``: they stay bf16 there (the transform's log line counts what it swapped).

``Float8Linear.from_float`` assigns the old module's ``weight`` Parameter to the new module, so the swap keeps
every parameter object, its name and its dtype: the optimizer, the checkpoint keys and Megatron's grad buffers
see the same parameters. MLA's absorbed path reads ``wkv_b.weight`` directly (nam56r/blocks/mla.py): that
product stays bf16 whichever class holds the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MULTIPLE = 16
"""``torch._scaled_mm`` needs both dims of each FP8 operand divisible by 16 (torchao's auto filter skips
others; here a selected projection that is not is refused by ``nam_check_config`` before the run)."""
RECIPES = ("tensorwise", "rowwise")
"""``torchao.float8.Float8LinearRecipeName`` values offered: per-tensor scales (cuBLAS) and per-row scales
rounded to powers of two (CUTLASS), e4m3 for inputs, weights and gradients in both."""


def _owners() -> dict[type, tuple[str, str]]:
    """Owner block class -> (what it is, in the log line; its projections' attribute paths)."""
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
    """The plain ``nn.Linear`` modules of the table above, in module order (an ``nn.Linear`` subclass, e.g. a
    ``Float8Linear`` already swapped, is not selected again)."""
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
    what ``nam_check_config`` judges before a run."""
    from nam56r.model import build_model

    return dense_projections(build_model(cfg, device="meta"))


def misaligned(projections: list[Projection]) -> list[Projection]:
    return [p for p in projections if not p.aligned]


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
    bad = misaligned(chosen)
    if bad:
        raise ValueError(f"float8.linears: dims not divisible by {MULTIPLE}: "
                         + ", ".join(p.describe() for p in bad[:4]) + (" ..." if len(bad) > 4 else ""))
    ids = {id(p.module) for p in chosen}
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: id(module) in ids,
                               config=torchao_config(recipe))
    by_part: dict[str, int] = {}
    for p in chosen:
        by_part[p.part] = by_part.get(p.part, 0) + 1
    parts = ", ".join(f"{part} {n}" for part, n in by_part.items()) or "none found"
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
