"""MoE: dense-over-experts forward equals a per-token loop over the chosen experts (float64)."""

import torch
import torch.nn.functional as F

from nam56r.blocks.mlp import SwiGLU
from nam56r.blocks.moe import MoE
from nam56r.config import NAM56RConfig
from nam56r.reference.moe import ReferenceExperts
from nam56r.state import ForwardState

CFG = NAM56RConfig(hidden=8, num_experts=5, moe_topk=2, moe_ffn_hidden=6, moe_shared_ffn_hidden=4)


def naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalise, run only the chosen experts, add the shared expert."""
    f = moe.w_down.shape[-1]
    out = torch.zeros_like(x)
    for i, tok in enumerate(x):
        p = torch.softmax(moe.router.weight @ tok, dim=-1)
        top_p, top_e = p.topk(moe.topk)
        for gate, e in zip(top_p / top_p.sum(), top_e.tolist()):
            gu = moe.w_gate_up[e] @ tok
            out[i] = out[i] + gate * (moe.w_down[e] @ (F.silu(gu[:f]) * gu[f:]))
        out[i] = out[i] + moe.shared(tok)
    return out


def test_moe_matches_per_token_loop_in_value_and_grad():
    torch.manual_seed(0)
    moe = MoE(CFG, ReferenceExperts()).double()
    for p in moe.parameters():  # init_std 0.02 makes routing nearly uniform; spread it so top-k is clear
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 3, CFG.hidden, dtype=torch.float64)
    r = torch.randn(2, 3, CFG.hidden, dtype=torch.float64)

    out = moe(x)
    grads = torch.autograd.grad((out * r).sum(), list(moe.parameters()))
    ref = naive_moe(moe, x.reshape(-1, CFG.hidden)).reshape(out.shape)
    ref_grads = torch.autograd.grad((ref * r).sum(), list(moe.parameters()))

    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-10, atol=1e-12)


def test_aux_loss_is_switch_formula_and_lands_in_state():
    torch.manual_seed(1)
    moe = MoE(CFG, ReferenceExperts()).double()
    torch.nn.init.normal_(moe.router.weight, std=0.5)
    x = torch.randn(2, 7, CFG.hidden, dtype=torch.float64)
    state = ForwardState()
    moe(x, state)
    (aux,) = state.aux_losses["moe_aux"]

    t = x.reshape(-1, CFG.hidden)
    p = torch.softmax(t @ moe.router.weight.T, dim=-1)
    counts = [0] * CFG.num_experts
    for row in p:
        for e in row.topk(CFG.moe_topk).indices.tolist():
            counts[e] += 1
    f = torch.tensor(counts, dtype=torch.float64) / (t.shape[0] * CFG.moe_topk)
    expected = CFG.moe_aux_loss_coeff * CFG.num_experts * (f * p.mean(0)).sum()
    torch.testing.assert_close(aux, expected, rtol=1e-12, atol=0)
    assert aux.requires_grad  # through P_e


def test_uniform_router_gives_aux_equal_to_coeff():
    moe = MoE(CFG, ReferenceExperts()).double()
    torch.nn.init.zeros_(moe.router.weight)  # p_e = 1/E for every token, whatever top-k picks
    state = ForwardState()
    moe(torch.randn(1, 5, CFG.hidden, dtype=torch.float64), state)
    assert abs(state.aux_losses["moe_aux"][0].item() - CFG.moe_aux_loss_coeff) < 1e-15


def test_builds_on_meta_with_expected_parameter_count():
    cfg = NAM56RConfig()
    with torch.device("meta"):
        moe = MoE(cfg, ReferenceExperts())
    d, e, f, fs = cfg.hidden, cfg.num_experts, cfg.moe_ffn_hidden, cfg.moe_shared_ffn_hidden
    expected = d * e + e * 3 * f * d + 3 * fs * d  # router + routed experts + shared expert
    assert sum(p.numel() for p in moe.parameters()) == expected
    assert all(p.is_meta for p in moe.parameters())


def test_swiglu_shapes():
    assert SwiGLU(8, 6)(torch.randn(2, 3, 8)).shape == (2, 3, 8)


def test_reference_experts_take_fp32_gates_with_bf16_rows_as_the_grouped_backend_rounds_them():
    """Megatron's flex dispatcher (DeepEP) hands the experts fp32 gates with bf16 rows; the reference rounds the
    gates to the rows' dtype (the grouped backend's ``gated_swiglu`` does the same), in both entry points."""
    torch.manual_seed(3)
    e, f, d, r = 3, 6, 8, 7
    x = torch.randn(r, d).bfloat16()
    w_gate_up, w_down = torch.randn(e, 2 * f, d).bfloat16(), torch.randn(e, d, f).bfloat16()
    probs = torch.rand(r) + 0.1
    counts = torch.tensor([3, 0, 4])
    experts = ReferenceExperts()
    out = experts.sorted(x, counts, probs, w_gate_up, w_down)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, experts.sorted(x, counts, probs.bfloat16(), w_gate_up, w_down), rtol=0, atol=0)
    chosen = torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0], [1, 0], [2, 1], [0, 2]])
    gates = torch.rand(r, 2)
    out = experts(x, chosen, gates, w_gate_up, w_down)
    torch.testing.assert_close(out, experts(x, chosen, gates.bfloat16(), w_gate_up, w_down), rtol=0, atol=0)
