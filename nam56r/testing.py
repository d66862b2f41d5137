"""Inputs shaped and scaled like NAM56R's own, for the parity checks of the plugins that implement its kinds.

``random_scan_inputs`` draws the arguments of an ``SSMScan`` (``nam56r.backends``) the way the Mamba-3 mixer
makes them (``nam56r/blocks/mamba3.py``), so the scan plugins and the benchmarks test their scans on one
distribution. It lives with the model, not in ``nam_core.testing``: the core knows no Mamba-3.

``prepare_corpus(tmp_path_factory, modules, chars)`` prepares a small dataset from the source of a few
standard-library modules as ``nam data prepare`` does (byte tokenizer, NAM56R's structure ids), faster than the
full stdlib default of ``nam train``.
"""

from __future__ import annotations

import math

import torch

SCAN_INPUTS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "d", "z", "mimo_x", "mimo_z",
               "mimo_o")
"""The ``SSMScan`` arguments, in the protocol's order."""


def random_scan_inputs(b: int, l: int, h: int, g: int, n: int, p: int, r: int, *, device, seed: int,
                       dtype: torch.dtype = torch.bfloat16, rope_fraction: float = 0.5,
                       shared_angles: bool = False) -> dict[str, torch.Tensor | None]:
    """The ``SSMScan`` arguments by name (``SCAN_INPUTS``), fp32, on ``device``; ``None`` for the MIMO
    projections when ``r == 1`` (SISO).

    B/C (``k``, ``q``) after RMSNorm (unit RMS), x and the gate N(0, 1); dt log-uniform over the init range
    [1e-3, 1e-1]; adt = -softplus(N(0, 1)) dt (negative); trap and the raw angles N(0, 1); biases and the MIMO
    projections near their init values (1, or 1/r for the rank sums) plus noise, D near 1. What a kernel reads
    in low precision (q, k, v, z, trap, angles) is rounded once to ``dtype`` and kept in fp32, so a reference
    given these values computes on exactly what the kernel reads. ``shared_angles``: one set of angles for every
    head, ``[b, l, 1, s]``, as the mixer makes them (the caller expands it to ``[b, l, h, s]``); else one set
    per head.
    """
    # drawn on ``device``: at a run's size (a launch check's) the host's generator took 3.6 s (H200 host)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def low(t):  # one rounding to the activation dtype, kept in fp32 storage
        return t.to(dtype).float()

    s = int(n * rope_fraction) // 2  # one angle per rotated pair
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(torch.rand(b, h, l, generator=gen, device=device) * (hi - lo) + lo)  # [b, h, l]
    x = {
        "q": low(randn(b, l, r, g, n)), "k": low(randn(b, l, r, g, n)), "v": low(randn(b, l, h, p)),
        "adt": -torch.nn.functional.softplus(randn(b, h, l)) * dt, "dt": dt, "trap": low(randn(b, h, l)),
        "q_bias": 1 + 0.1 * randn(h, r, n), "k_bias": 1 + 0.1 * randn(h, r, n),
        "angles": low(randn(b, l, 1 if shared_angles else h, s)), "d": 1 + 0.1 * randn(h),
        "z": low(randn(b, l, h, p)),
        "mimo_x": 1 / r + 0.1 * randn(h, r, p) if r > 1 else None,
        "mimo_z": 1 + 0.1 * randn(h, r, p) if r > 1 else None,
        "mimo_o": 1 / r + 0.1 * randn(h, r, p) if r > 1 else None,
    }
    return x  # every tensor drawn on ``device``


EXPERT_GRADS = ("x", "gates", "w_gate_up", "w_down")
"""The differentiable ``MoEExperts`` arguments."""


def random_expert_inputs(t: int, d: int, num_experts: int, k: int, f: int, *, device, seed: int,
                         balanced: bool = False) -> dict[str, torch.Tensor]:
    """The ``MoEExperts`` arguments by name, bf16 on ``device``, plus ``dy`` (an output gradient).

    Tokens N(0, 1) of width ``d``; ``E`` stacked SwiGLU experts at init scale ``d**-0.5`` / ``f**-0.5``; top-k
    routing from random router logits (scaled 2x, so expert loads differ and some experts may get no row),
    gates the renormalised top-k softmax. ``balanced``: every expert gets the same number of rows (tokens
    assigned round-robin), the benchmark's best case.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, num_experts, generator=gen) * 2.0
    if balanced:
        first = torch.arange(t).unsqueeze(1) * k + torch.arange(k)  # [t, k] consecutive slots
        bonus = torch.zeros(t, num_experts).scatter_(1, first % num_experts, 100.0)
        logits = logits + bonus
    top_p, chosen = logits.softmax(-1).topk(k, dim=-1)
    return {
        "x": torch.randn(t, d, generator=gen).to(device, torch.bfloat16),
        "chosen": chosen.to(device),
        "gates": (top_p / top_p.sum(-1, keepdim=True)).to(device, torch.bfloat16),
        "w_gate_up": (torch.randn(num_experts, 2 * f, d, generator=gen) * d**-0.5).to(device, torch.bfloat16),
        "w_down": (torch.randn(num_experts, d, f, generator=gen) * f**-0.5).to(device, torch.bfloat16),
        "dy": torch.randn(t, d, generator=gen).to(device, torch.bfloat16),
    }


def run_experts(experts, inputs: dict, dtype: torch.dtype, state=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and the gradients of ``EXPERT_GRADS`` for one forward + backward of ``experts`` in ``dtype``."""
    leaves = {n: inputs[n].to(dtype, copy=True).requires_grad_() for n in EXPERT_GRADS}
    y = experts(leaves["x"], inputs["chosen"], leaves["gates"], leaves["w_gate_up"], leaves["w_down"], state)
    y.backward(inputs["dy"].to(y.dtype))
    return y.detach(), [leaves[n].grad for n in EXPERT_GRADS]


def compare_experts(experts, *, t: int = 512, d: int = 256, num_experts: int = 8, k: int = 2, f: int = 64,
                    device="cuda", seed: int | None = None, calls: int = 1) -> dict:
    """``||ours - ref|| / ||ref||`` of the output and every gradient of ``experts`` (run in bf16) against the
    reference experts in fp32 on the same bf16 values, worst over ``calls`` calls (a stateful backend, e.g.
    an amax history, differs between its first call and later ones), plus the ``seed``."""
    from nam56r.reference.moe import ReferenceExperts
    from nam_core.testing import new_seed, rel_norm_error

    seed = new_seed() if seed is None else seed
    inputs = random_expert_inputs(t, d, num_experts, k, f, device=device, seed=seed)
    state = experts.layer_state(None)
    if state is not None:
        state.to(device)
    ref_y, ref_grads = run_experts(ReferenceExperts(), inputs, torch.float32)
    names = ("out", *(f"d{n}" for n in EXPERT_GRADS))
    errors = dict.fromkeys(names, 0.0)
    for _ in range(calls):
        y, grads = run_experts(experts, inputs, torch.bfloat16, state)
        for name, a, r in zip(names, [y, *grads], [ref_y, *ref_grads]):
            errors[name] = max(errors[name], rel_norm_error(a, r))
    return {**errors, "seed": seed}


def worst_error(errors: dict) -> float:
    """The largest error of a ``compare_experts`` result."""
    return max(v for k, v in errors.items() if k != "seed")


# --- the checks every ``moe`` backend owes (each plugin's tests call them with its backend) ----------------


def expert_errors(experts, inputs: dict, dtype: torch.dtype = torch.float64) -> dict[str, float]:
    """``max |ours - ref| / max |ref|`` of the output and every gradient of ``experts`` against the reference
    experts, both run in ``dtype`` on ``inputs`` (``random_expert_inputs``)."""
    from nam56r.reference.moe import ReferenceExperts
    from nam_core.testing import max_rel_error

    ref_y, ref_g = run_experts(ReferenceExperts(), inputs, dtype)
    y, g = run_experts(experts, inputs, dtype)
    return {name: max_rel_error(a, r)
            for name, a, r in zip(("out", *(f"d{n}" for n in EXPERT_GRADS)), [y, *g], [ref_y, *ref_g])}


def idle_expert_inputs(t: int, d: int, num_experts: int, k: int, f: int, *, busy: int, seed: int,
                       device="cpu") -> dict[str, torch.Tensor]:
    """``random_expert_inputs`` routed to the first ``busy`` experts only: experts ``busy..E-1`` get no row
    (an empty group in a grouped GEMM; no gradient for their weights)."""
    inputs = random_expert_inputs(t, d, num_experts, k, f, device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    inputs["chosen"] = torch.randn(t, busy, generator=gen).topk(k).indices.to(device)
    return inputs


def sorted_entry_error(experts, inputs: dict) -> float:
    """``max |ours - ref| / max |ref|`` of ``experts.sorted`` against the reference's, in float64, on rows
    sorted by expert with one gate each (the layout Megatron's dispatcher hands the experts slot)."""
    from nam56r.experts import sort_by_expert
    from nam56r.reference.moe import ReferenceExperts
    from nam_core.testing import max_rel_error

    w1, w2 = inputs["w_gate_up"].double(), inputs["w_down"].double()
    by = sort_by_expert(inputs["chosen"], w1.shape[0])
    x = inputs["x"].double().index_select(0, by.tokens)
    probs = inputs["gates"].double().flatten().index_select(0, by.order)
    return max_rel_error(experts.sorted(x, by.counts, probs, w1, w2), ReferenceExperts().sorted(x, by.counts, probs,
                                                                                                w1, w2))


class HostReadingExperts:
    """Any experts plus one host read of the per-expert counts (what a per-expert loop does): the control that
    shows ``moe_step_without_host_sync`` catches a sync."""

    def __init__(self, inner):
        self.inner = inner

    def layer_state(self, cfg):
        return self.inner.layer_state(cfg)

    def __call__(self, x, chosen, gates, w_gate_up, w_down, state=None):
        from nam56r.experts import sort_by_expert

        sort_by_expert(chosen, w_gate_up.shape[0]).counts.tolist()
        return self.inner(x, chosen, gates, w_gate_up, w_down, state)


def moe_step_without_host_sync(experts) -> None:
    """One forward + backward of a MoE block (hidden 512, NAM56R's 16 experts of 160, top-4, 2 x 1024 tokens,
    bf16, CUDA) on ``experts`` under ``torch.cuda.set_sync_debug_mode("error")``, after one warm-up step
    (allocator, compiles, cuBLAS handles): raises RuntimeError at the first synchronizing operation."""
    from nam56r.blocks.moe import MoE
    from nam56r.config import NAM56RConfig

    cfg = NAM56RConfig(hidden=512, moe_ffn_hidden=160, moe_shared_ffn_hidden=320, num_experts=16, moe_topk=4)
    moe = MoE(cfg, experts).to("cuda", torch.bfloat16)
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().mean().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe(x).float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def prepare_corpus(tmp_path_factory, modules, chars: int):
    """The first ``chars`` characters of each module's source, prepared as ``nam data prepare SRC --out DIR``
    prepares it (byte tokenizer, structure ids): the dataset folder."""
    import inspect

    from nam56r.blocks.structure import char_structure_ids
    from nam_core.data.prepare import prepare
    from nam_core.data.tokenizer import load_tokenizer

    src = tmp_path_factory.mktemp("src")
    for i, mod in enumerate(modules):
        (src / f"m{i}.py").write_text(inspect.getsource(mod)[:chars])
    out = tmp_path_factory.mktemp("data") / "ds"
    prepare(src, out, load_tokenizer("byte"), annotate=char_structure_ids, progress=False)
    return out
