"""TE linears against their references on fresh random inputs: bf16 against torch's linear in bf16, FP8 against
torch's linear in fp32 (the self-tests at activation and tests/test_te_gpu.py both measure with this)."""

from __future__ import annotations

import torch
from torch import nn

from nam_core.testing import rel_norm_error

WARMUP = 2
"""Forward + backward passes before the measured one: delayed scaling starts from scale 1 with an empty amax
history, so its first pass quantizes the weights (~d_in^-0.5) mostly to subnormals; after one step the scales
follow the tensors. Current and blockwise scaling have no state, so the warm-up changes nothing for them."""


def _inputs(tokens: int, d_in: int, d_out: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(d_out, d_in, generator=g) * d_in**-0.5).to(device, torch.bfloat16)
    dy = torch.randn(tokens, d_out, generator=g).to(device, torch.bfloat16)
    return x, w, dy


def _run(lin: nn.Module, x: torch.Tensor, dy: torch.Tensor, passes: int):
    """The output and the input and weight gradients of the last of ``passes`` forward + backward passes."""
    for _ in range(passes):
        lin.weight.grad = None
        xi = x.detach().clone().requires_grad_()
        y = lin(xi)
        y.backward(dy.to(y.dtype))
    return y.detach(), xi.grad, lin.weight.grad


def linear_errors(fp8: str, *, tokens: int = 4096, d_in: int = 1024, d_out: int = 2048, seed: int = 0,
                  device="cuda", te=None) -> dict[str, float]:
    """``||te - ref|| / ||ref||`` of the output and of the input and weight gradients of a TE linear holding a
    bf16 weight: ``fp8="off"`` against ``nn.Linear`` in bf16 on the same values (the same GEMM in another
    library), an FP8 recipe against ``nn.Linear`` in fp32 (what FP8 costs). ``te``: the TE module (tests pass
    a stand-in)."""
    from nam_plugin_te.linears import _te, te_linear_from
    from nam_plugin_te.recipes import OFF, te_recipe

    te = te if te is not None else _te()
    x, w, dy = _inputs(tokens, d_in, d_out, seed, device)
    ref_dtype = torch.bfloat16 if fp8 == OFF else torch.float32
    ref = nn.Linear(d_in, d_out, bias=False, device=device, dtype=ref_dtype)
    ours = nn.Linear(d_in, d_out, bias=False, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(w.to(ref_dtype))
        ours.weight.copy_(w)
    ours = te_linear_from(ours, te, None if fp8 == OFF else te_recipe(fp8))
    want = _run(ref, x.to(ref_dtype), dy, 1)
    got = _run(ours, x, dy, 1 + (WARMUP if fp8 != OFF else 0))
    return {name: rel_norm_error(a, r) for name, a, r in zip(("out", "dx", "dweight"), got, want)}
