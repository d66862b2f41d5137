"""Parity of the fp8 experts against the reference experts, used by preflight, the tests and the benchmark.

Inputs: ``t`` bf16 tokens of width ``d`` (unit normal), ``E`` stacked SwiGLU experts at init scale
``d**-0.5``, top-``k`` routing from random router logits (so expert loads differ), gates = renormalised
top-k softmax, requiring grad; a random output gradient. The reference is ``ReferenceExperts`` in fp32 on the
same bf16 values. Errors are ``||ours - ref|| / ||ref||`` (``nam_core.testing.rel_norm_error``) for the
output and the gradients of x, the gates and both expert weights.
"""

from __future__ import annotations

import torch

from nam_core.testing import new_seed, rel_norm_error

TOLERANCE = {"fp8": 0.15, "bf16": 1e-2}
"""Largest error accepted per precision. fp8: each E4M3 rounding is off by up to 2^-4 relative and each E5M2
one by 2^-3; measured on CPU (``torch._scaled_mm``), the output lands near 0.065 and the input gradient
(E5M2 x E4M3) near 0.093. A wrong expert, row or scale is off by order 1, and one wrong expert of 8 by ~0.35.
bf16: the same dispatch with bf16 GEMMs (~0.003 measured)."""


def random_inputs(t: int, d: int, num_experts: int, k: int, f: int, *, device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, num_experts, generator=g) * 2.0
    probs = logits.softmax(-1)
    top_p, chosen = probs.topk(k, dim=-1)
    return {
        "x": torch.randn(t, d, generator=g).to(device, torch.bfloat16),
        "chosen": chosen.to(device),
        "gates": (top_p / top_p.sum(-1, keepdim=True)).to(device, torch.bfloat16),
        "w_gate_up": (torch.randn(num_experts, 2 * f, d, generator=g) * d**-0.5).to(device, torch.bfloat16),
        "w_down": (torch.randn(num_experts, d, f, generator=g) * f**-0.5).to(device, torch.bfloat16),
        "dy": torch.randn(t, d, generator=g).to(device, torch.bfloat16),
    }


def _run(experts, inputs: dict, dtype: torch.dtype, state) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = {n: inputs[n].to(dtype, copy=True).requires_grad_() for n in ("x", "gates", "w_gate_up", "w_down")}
    y = experts(leaves["x"], inputs["chosen"], leaves["gates"], leaves["w_gate_up"], leaves["w_down"], state)
    y.backward(inputs["dy"].to(y.dtype))
    return y.detach(), [leaves[n].grad for n in ("x", "gates", "w_gate_up", "w_down")]


def compare(experts, *, t: int = 512, d: int = 256, num_experts: int = 8, k: int = 2, f: int = 64, device="cuda",
            seed: int | None = None, calls: int = 2) -> dict:
    """Errors of ``experts`` (an ``FP8Experts``) against the reference, worst over ``calls`` calls (the first
    call scales from its own amax, later ones from the history), plus the ``seed``."""
    from nam56r.reference.moe import ReferenceExperts

    seed = new_seed() if seed is None else seed
    inputs = random_inputs(t, d, num_experts, k, f, device=device, seed=seed)
    state = experts.layer_state(None)
    if state is not None:
        state.to(device)
    ref_y, ref_grads = _run(ReferenceExperts(), inputs, torch.float32, None)
    names = ("out", "dx", "dgates", "dw_gate_up", "dw_down")
    errors = dict.fromkeys(names, 0.0)
    for _ in range(calls):
        y, grads = _run(experts, inputs, torch.bfloat16, state)
        for name, a, r in zip(names, [y, *grads], [ref_y, *ref_grads]):
            errors[name] = max(errors[name], rel_norm_error(a, r))
    return {**errors, "seed": seed}


def worst(errors: dict) -> float:
    return max(v for k, v in errors.items() if k != "seed")
