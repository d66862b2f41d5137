"""The megatron engine's part of the transform: TE's gradient-accumulation fusion in every TE linear of a chunk.

Megatron's DDP gives each parameter an fp32 ``main_grad`` (a view of its grad buffer) and, after each
backward, adds ``param.grad`` into it: one extra read and write of every weight gradient per micro-batch (the
``main_grad`` accumulation of issue 29's profile). With ``fuse_wgrad_accumulation`` a TE linear's wgrad GEMM
writes into ``main_grad`` itself (``accumulate=True``, fp32 output) and marks ``grad_added_to_main_grad``, so
DDP skips the add.

Megatron's own switch is ``TransformerConfig.gradient_accumulation_fusion``, read when each linear is built.
nam does not set it: the same flag makes Megatron's local ``ColumnParallelLinear`` (the output layer, whose
weight the CE backend uses) refuse to build without APEX's ``fused_weight_gradient_mlp_cuda``. Instead the
transform sets the TE modules' own attribute, which TE reads at every forward, after the chunk is built and
before its DDP wrapper: Megatron's TE modules (shared expert, MTP, grouped experts) and nam's swapped
projections alike. Only on the megatron engine: the local engine has no ``main_grad``.
"""

from __future__ import annotations

from torch import nn


def fuse_wgrad_accumulation(model: nn.Module, te) -> str:
    """Turn on ``fuse_wgrad_accumulation`` in every TE module of ``model`` that has it; the log line.
    ``te``: the ``transformer_engine.pytorch`` module (tests pass a stand-in)."""
    base = te.module.base.TransformerEngineBaseModule
    turned = [m for m in model.modules() if isinstance(m, base) and hasattr(m, "fuse_wgrad_accumulation")]
    for m in turned:
        m.fuse_wgrad_accumulation = True
    return f"TE gradient-accumulation fusion (wgrad GEMM into main_grad) in {len(turned)} TE modules"
