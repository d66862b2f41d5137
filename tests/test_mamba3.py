"""Mamba-3: the chunked reference scan against the step-by-step oracle, and the mixer block around it.

Sizes are tiny (l = 37, not a multiple of any chunk) and every coefficient is random, so decay, the trapezoid
mix and the rotation all change from token to token.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from nam56r.backends import SSMScan
from nam56r.blocks.mamba3 import Mamba3Mixer
from nam56r.config import NAM56RConfig
from nam56r.reference.mamba3 import ReferenceSSMScan, mamba3_step_scan, rotate_adjacent, rotate_half
from nam_core.testing import HostSyncError, no_host_sync

SCAN_ARGS = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "d", "z", "mimo_x", "mimo_z", "mimo_o")


def scan_inputs(*, b=2, l=37, h=8, p=8, n=16, g=1, r=1, s=4, dtype=torch.float64, seed=0) -> dict:
    """Random ``SSMScan`` inputs shaped as backends.py documents, in ranges the mixer produces."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)  # noqa: E731
    dt = F.softplus(rand(b, h, l) - 1.0)  # ~0.1 .. 2
    a = -F.softplus(rand(b, h, l))  # A < 0, so alpha = exp(A dt) spans ~0.05 .. 1
    mimo = [rand(h, r, p) for _ in range(3)] if r > 1 else [None] * 3
    return dict(
        q=F.rms_norm(rand(b, l, r, g, n), (n,)), k=F.rms_norm(rand(b, l, r, g, n), (n,)),
        v=rand(b, l, h, p), adt=a * dt, dt=dt, trap=2 * rand(b, h, l),  # lam = sigmoid spans ~0.1 .. 0.9
        q_bias=rand(h, r, n), k_bias=rand(h, r, n), angles=2 * rand(b, l, h, s), d=rand(h), z=rand(b, l, h, p),
        mimo_x=mimo[0], mimo_z=mimo[1], mimo_o=mimo[2],
    )


# (h, g, r, s, chunk): SISO with one group, a group per head, 8 groups over 16 heads; MIMO rank 4 likewise;
# s = 4 is rope_fraction 0.5 of n = 16, s = 8 is 1.0; chunk 64 > l is the one-chunk case.
SCAN_CASES = [
    (8, 1, 1, 4, 8), (8, 8, 1, 4, 16), (16, 8, 1, 8, 8),
    (16, 1, 4, 4, 8), (16, 8, 4, 4, 16), (16, 2, 4, 8, 64),
]


@pytest.mark.parametrize("h,g,r,s,chunk", SCAN_CASES)
def test_chunked_scan_matches_step_recurrence(h, g, r, s, chunk):
    x = scan_inputs(h=h, g=g, r=r, s=s)
    got = ReferenceSSMScan()(**x, chunk_size=chunk)
    want = mamba3_step_scan(**x)
    assert got.shape == (2, 37, h, 8) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)  # float64: both land within ~1e-13


@pytest.mark.parametrize("r", [1, 4])
def test_bf16_inputs_are_scanned_in_fp32_and_returned_in_bf16(r):
    x = scan_inputs(r=r, dtype=torch.float32)
    x16 = {k: t if t is None or k in ("adt", "dt", "q_bias", "k_bias", "d") else t.bfloat16() for k, t in x.items()}
    got = ReferenceSSMScan()(**x16, chunk_size=8)
    assert got.dtype == torch.bfloat16
    # same bf16-rounded inputs through the fp64 oracle: only the final bf16 rounding (2^-8 relative) remains
    want = mamba3_step_scan(**{k: None if t is None else t.double() for k, t in x16.items()})
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7 * want.abs().max().item())


@pytest.mark.parametrize("h,g,r,s", [(8, 2, 1, 4), (16, 8, 4, 4)])
def test_chunked_scan_gradients_match_step_recurrence(h, g, r, s):
    x = scan_inputs(h=h, g=g, r=r, s=s, seed=1)
    cotangent = torch.randn(2, 37, h, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    names = [k for k in SCAN_ARGS if x[k] is not None]

    def grads(scan):
        leaves = {k: x[k].clone().requires_grad_() for k in names}
        out = scan(**{**x, **leaves}, chunk_size=8)
        return torch.autograd.grad((out * cotangent).sum(), [leaves[k] for k in names])

    for name, got, want in zip(names, grads(ReferenceSSMScan()), grads(mamba3_step_scan)):
        assert want.abs().sum() > 0, f"d/d{name} is zero: the test would not see a wrong gradient"
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m: f"d/d{name}: {m}")


def test_rotation_conventions():
    """Adjacent pairs are a complex multiply by e^{i phi}; half pairs are the same thing on permuted dims."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    phi = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    as_complex = torch.view_as_complex(x[:, :8].reshape(5, 4, 2).contiguous()) * torch.polar(torch.ones_like(phi), phi)
    want = torch.cat([torch.view_as_real(as_complex).flatten(1), x[:, 8:]], dim=1)
    torch.testing.assert_close(rotate_adjacent(x, phi), want, rtol=0, atol=1e-14)

    # half layout puts pair i at (i, i + 8); gather those into adjacent slots, rotate, scatter back.
    perm = torch.tensor([0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15])
    back = torch.argsort(perm)
    torch.testing.assert_close(rotate_half(x, phi), rotate_adjacent(x[:, perm], phi)[:, back], rtol=0, atol=1e-14)
    for dims in (slice(4, 8), slice(12, 16)):  # rope_fraction 0.5: blocks 1 and 3 pass through
        assert torch.equal(rotate_half(x, phi)[:, dims], x[:, dims])


@pytest.mark.parametrize("g,r", [(2, 1), (2, 4)])
def test_single_token_closed_form(g, r):
    """At l = 1, S_0 = gamma_0 sum_r v_r k_r^T and the phase is shared by q and k, so the dot is unrotated:
    out = sum_r (gamma (q_r . k) v + D v_r) silu(z mimo_z_r) mimo_o_r, with head h reading group h // (h/g)."""
    h, p = 8, 8
    x = scan_inputs(l=1, h=h, g=g, r=r)
    head_group = torch.arange(h) // (h // g)
    q = x["q"][0, 0][:, head_group] + x["q_bias"].transpose(0, 1)  # [r, h, n]
    k = x["k"][0, 0][:, head_group] + x["k_bias"].transpose(0, 1)
    ones = torch.ones(h, r, p, dtype=torch.float64)
    mx, mz, mo = (ones if m is None else m for m in (x["mimo_x"], x["mimo_z"], x["mimo_o"]))
    v = x["v"][0, 0].unsqueeze(0) * mx.transpose(0, 1)  # [r, h, p]
    gamma = torch.sigmoid(x["trap"][0, :, 0]) * x["dt"][0, :, 0]  # [h]
    y = gamma[:, None] * torch.einsum("rhn,shn,shp->rhp", q, k, v) + x["d"][:, None] * v
    want = (y * F.silu(x["z"][0, 0] * mz.transpose(0, 1)) * mo.transpose(0, 1)).sum(0)  # [h, p]
    torch.testing.assert_close(ReferenceSSMScan()(**x, chunk_size=8)[0, 0], want, rtol=1e-12, atol=1e-12)


# --- the mixer ----------------------------------------------------------------------------------------------


def tiny_cfg(rank: int) -> NAM56RConfig:
    # hidden 32 -> d_inner 64 -> 8 heads of 8; 2 groups; n 16 -> 4 rope angles; chunk 8 < l = 37
    return NAM56RConfig(hidden=32, d_state=16, mamba_headdim=8, mamba_ngroups=2, mamba_mimo_rank=rank, mamba_chunk=8)


def tiny_mixer(rank: int, seed: int = 0) -> Mamba3Mixer:
    """A mixer whose every parameter is off its init, so no path is hidden by a constant (trap 0.5, D 1 ...)."""
    torch.manual_seed(seed)
    m = Mamba3Mixer(tiny_cfg(rank), ReferenceSSMScan())
    with torch.no_grad():
        m.in_proj.weight.normal_(std=0.3)  # pre-activations ~N(0, 1.7^2): dd_A, trap, angles all vary
        for p in (m.D, m.B_bias, m.C_bias, m.B_norm.weight, m.C_norm.weight, m.mimo_x, m.mimo_z, m.mimo_o):
            if p is not None:
                p.add_(0.3 * torch.randn_like(p))
    return m


def mixer_input(seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """The same numbers whatever the dtype (drawn in fp32, then cast)."""
    return torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_mixer_shapes_on_meta_device():
    """NAM56R's own sizes build on meta (no memory), and in_proj has section 1.1's width."""
    cfg = NAM56RConfig()
    with torch.device("meta"):
        m = Mamba3Mixer(cfg, ReferenceSSMScan())
    # 2 d_inner + 2 N G R + 3 H + S = 2*8192 + 2*128*8*4 + 3*128 + 32
    assert m.in_proj.weight.shape == (24992, 4096)
    assert m.B_bias.shape == (128, 4, 128) and m.mimo_o.shape == (128, 4, 64) and m.angles == 32
    assert all(p.is_meta for p in m.parameters())
    assert isinstance(m.scan, SSMScan)
    with torch.device("meta"):
        small = Mamba3Mixer(tiny_cfg(4), ReferenceSSMScan())
        assert small(torch.empty(2, 37, 32)).shape == (2, 37, 32)


def test_dt_bias_init_is_inverse_softplus_of_dt_range():
    cfg = tiny_cfg(1)
    dt = F.softplus(Mamba3Mixer(cfg, ReferenceSSMScan()).dt_bias)
    assert (dt >= cfg.mamba_dt_min * (1 - 1e-5)).all() and (dt <= cfg.mamba_dt_max * (1 + 1e-5)).all()


@pytest.mark.parametrize("rank", [1, 4])
def test_mixer_fp32_matches_float64(rank):
    m = tiny_mixer(rank)
    m64 = copy.deepcopy(m).to(torch.float64)
    assert m64.D.dtype == torch.float64  # widening is allowed; only narrowing below fp32 is refused
    out = m(mixer_input())
    want = m64(mixer_input(dtype=torch.float64))
    # measured max |diff| / max |want| = 2e-7 .. 8e-7 over seeds 0-2, ranks 1 and 4 (fp32 rounding); elementwise
    # relative error is large only where the output crosses zero, hence an absolute term at 1e-5 of the scale
    scale = want.abs().max().item()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5 * scale)


def test_bf16_cast_keeps_scan_parameters_fp32():
    m = tiny_mixer(4)
    before = {n: getattr(m, n).detach().clone() for n in Mamba3Mixer.FP32_PARAMS}
    m.to(torch.bfloat16)
    assert m.in_proj.weight.dtype == torch.bfloat16 and m.mimo_x.dtype == torch.bfloat16
    for name, value in before.items():
        param = getattr(m, name)
        assert param.dtype == torch.float32, name
        assert torch.equal(param, value), f"{name} lost bits on the way through bf16"
    out = m(mixer_input(dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    out.float().square().mean().backward()
    assert all(getattr(m, n).grad.dtype == torch.float32 for n in Mamba3Mixer.FP32_PARAMS)
    m.half()  # the other narrowing path
    assert all(getattr(m, n).dtype == torch.float32 for n in Mamba3Mixer.FP32_PARAMS)


@pytest.mark.parametrize("rank", [1, 4])
def test_mixer_forward_backward_has_no_host_sync(rank):
    m = tiny_mixer(rank)
    x = mixer_input().requires_grad_()
    with no_host_sync():
        m(x).square().mean().backward()
    assert x.grad is not None


def test_no_host_sync_catches_a_sync():
    """The check above can fail: a data-dependent branch inside the block raises."""
    x = mixer_input()
    with pytest.raises(HostSyncError), no_host_sync():
        if x.sum() > 0:  # bool(tensor) reads the value on the host
            pass


@pytest.mark.parametrize("rank", [1, 4])
def test_gradients_reach_every_parameter(rank):
    m = tiny_mixer(rank)
    m(mixer_input()).square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} gets no gradient"
    assert math.isfinite(sum(p.grad.square().sum().item() for p in m.parameters()))


@pytest.mark.parametrize("rank", [1, 4])
def test_prelude_traces_as_one_graph_and_matches_eager(rank):
    """``mamba_compile_prelude``: the elementwise region must trace without graph breaks (``fullgraph``), so one
    compiled graph serves every layer; dynamo's eager backend checks the trace here without a C compiler (the
    inductor build and its speed-up are measured on the GPU by bench/mamba_ssm.py)."""
    from nam56r.blocks.mamba3 import mamba3_prelude

    m = tiny_mixer(rank)
    proj = m.in_proj(mixer_input())
    args = (proj, m.dt_bias, m.B_bias, m.C_bias, m.B_norm.weight, m.C_norm.weight, m.D, m.split_sizes,
            (m.rank, m.groups, m.d_state, m.heads, m.headdim), m.cfg.mamba_a_floor, 1e-5)
    torch._dynamo.reset()
    traced = torch.compile(mamba3_prelude, backend="eager", fullgraph=True, dynamic=False)
    for got, want in zip(traced(*args), mamba3_prelude(*args), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # and the flag routes the mixer through the compiled function, with the same output
    flagged = copy.deepcopy(m)
    flagged.cfg = m.cfg.replace(mamba_compile_prelude=True)
    import nam56r.blocks.mamba3 as block

    calls = []

    def counted(*a):
        calls.append(1)
        return traced(*a)

    saved = block._COMPILED_PRELUDE
    block._COMPILED_PRELUDE = counted
    try:
        torch.testing.assert_close(flagged(mixer_input()), m(mixer_input()), rtol=0, atol=0)
    finally:
        block._COMPILED_PRELUDE = saved
    assert calls == [1]  # the flagged mixer ran the compiled function; the plain one did not


class ContiguityLog:
    """The reference scan, noting whether v and z arrived contiguous (what mamba-ssm's kernels read)."""

    def __init__(self):
        self.scan, self.seen = ReferenceSSMScan(), []

    def __call__(self, q, k, v, *args, **kwargs):
        self.seen.append((v.is_contiguous(), args[-4].is_contiguous()))  # args[-4]: z
        return self.scan(q, k, v, *args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compile_prelude", [False, True])
def test_split_in_proj_equals_one_in_proj_and_hands_z_and_x_over_contiguous(dtype, compile_prelude):
    """``mamba_split_in_proj``: three GEMMs on slices of in_proj's weight give the one-GEMM mixer's output and
    every gradient (fp32 within 1e-5 of the max value: GEMMs of another width may block their sums differently;
    bf16 within 2**-7 relative L2), eager and with the inductor-compiled prelude, and the scan reads z and x
    contiguous (no copy left for a kernel to make), where one GEMM hands it strided views."""
    from nam_core.testing import max_rel_error, new_seed, rel_norm_error

    seed = new_seed()
    one = tiny_mixer(4, seed=seed % 1000)
    one.cfg = one.cfg.replace(mamba_compile_prelude=compile_prelude)
    split = copy.deepcopy(one)
    split.cfg = one.cfg.replace(mamba_split_in_proj=True)
    one, split = one.to(dtype), split.to(dtype)
    one.scan, split.scan = ContiguityLog(), ContiguityLog()
    x = mixer_input(seed % 1000, dtype)

    def run(m):
        xx = x.clone().requires_grad_()
        y = m(xx)
        y.float().square().mean().backward()
        return [y.detach(), xx.grad, *(p.grad for p in m.parameters())]

    for got, want in zip(run(split), run(one), strict=True):
        err = max_rel_error(got, want) if dtype == torch.float32 else rel_norm_error(got, want)
        assert err < (1e-5 if dtype == torch.float32 else 2**-7), (err, seed)
    assert split.scan.seen == [(True, True)] and one.scan.seen == [(False, False)]


def test_split_in_proj_refuses_a_swapped_in_proj():
    from nam_core.errors import CannotRunHere

    class SwappedLinear(torch.nn.Linear):  # what float8's or te's swap puts in in_proj's place
        pass

    m = tiny_mixer(4)
    m.cfg = m.cfg.replace(mamba_split_in_proj=True)
    old = m.in_proj
    m.in_proj = SwappedLinear(old.in_features, old.out_features, bias=False)
    with pytest.raises(CannotRunHere, match="mamba_split_in_proj=true .*SwappedLinear") as err:
        m(mixer_input())
    assert err.value.hint == "--set mamba_split_in_proj=false"
