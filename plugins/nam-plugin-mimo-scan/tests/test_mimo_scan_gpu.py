"""mimo-scan on the GPU host: bf16 parity of the output and every input gradient against the fp32 reference at
NAM56R's widths (ngroups 1, 8, 128; a length that is not a multiple of the tile), CUDA-graph capture, no host
syncs, the preflight launch. Marked gpu: skipped with a reason where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

N, P, R = 128, 64, 4  # NAM56R: d_state 128, headdim 64, rank 4
TOLERANCE = 2e-2  # ||a - ref|| / ||ref|| per tensor, bf16
MAX_TOLERANCE = 5e-2  # max |a - ref| / max |ref| per tensor, bf16


@pytest.mark.parametrize("g, block_t", [(1, None), (8, None), (128, None), (8, 32)])
def test_matches_the_reference_in_bf16_at_nam56r_widths(g, block_t):
    """h=128 heads of 64, l=1000 (not a multiple of the 16- or 32-token tile), b=1; every gradient by name.

    Bound: ||a - ref|| / ||ref|| <= 2e-2 per tensor (bf16 dot operands, ~4e-3 per rounding, two or three on a
    gradient's path) and max |a - ref| / max |ref| <= 5e-2 (a single element; d angles, a reverse cumsum over
    l of products with cancellation, measured 1.4e-2..1.9e-2; upstream's MIMO tests accept 0.10)."""
    from nam_plugin_mimo_scan.selftest import compare

    errors = compare(1, 1000, 128, g, N, P, R, device="cuda", dtype=torch.bfloat16, block_t=block_t, norms=True)
    seed, norm = errors.pop("seed"), errors.pop("norm")
    print(f"g={g} block_t={block_t} seed={seed} max: " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    print("  norm: " + " ".join(f"{k}={v:.2e}" for k, v in norm.items()))
    bad = {k: v for k, v in norm.items() if not v <= TOLERANCE}
    assert not bad, f"seed {seed}: norm error over {TOLERANCE}: {bad}"
    bad = {k: v for k, v in errors.items() if not v <= MAX_TOLERANCE}
    assert not bad, f"seed {seed}: max error over {MAX_TOLERANCE}: {bad}"


def test_the_kernels_sigmoid_is_within_a_few_ulp_of_tritons_and_of_the_exact_value():
    """``kernels._sigmoid`` (ex2.approx, rcp.approx, denormals flushed) against ``tl.sigmoid`` (div.full), which
    the kernels took before, and against float64: within 4 fp32 ulp of Triton's over x in [-87, 87] (outputs in
    fp32's normal range); against the exact value both carry the rounding of x * log2(e) into the exponent, up to
    |x| 2^-24 relative (~4e-6 at |x| = 80), so that bound is |x| 2^-23 + 4 ulp."""
    import triton
    import triton.language as tl

    from nam_plugin_mimo_scan import kernels

    @triton.jit
    def both(x_ptr, ours_ptr, theirs_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < n, other=0.0)
        tl.store(ours_ptr + i, kernels._sigmoid(x), mask=i < n)
        tl.store(theirs_ptr + i, tl.sigmoid(x), mask=i < n)

    gen = torch.Generator(device="cuda").manual_seed(3)
    spread = torch.randn(1 << 18, device="cuda", generator=gen) * 8
    ramp = torch.linspace(-87, 87, 1 << 18, device="cuda")
    x = torch.cat([ramp, spread, torch.zeros(1, device="cuda")]).clamp(-87, 87)
    ours, theirs = torch.empty_like(x), torch.empty_like(x)
    both[(triton.cdiv(x.numel(), 1024),)](x, ours, theirs, x.numel(), BLOCK=1024)
    exact = torch.sigmoid(x.double())
    ulp = (torch.nextafter(exact.float(), torch.full_like(x, 2.0)) - exact.float()).double()
    assert ((ours.double() - theirs.double()).abs() <= 4 * ulp).all(), \
        f"over 4 ulp of tl.sigmoid: {((ours.double() - theirs.double()).abs() / ulp).max():.1f} ulp"
    bound = x.double().abs() * 2.0**-23 * exact + 4 * ulp
    assert ((ours.double() - exact).abs() <= bound).all()
    assert ours[-1].item() == 0.5  # sigmoid(0), exactly


def test_the_kernels_cos_and_sin_of_a_phase_are_within_2e_6_of_the_exact_values():
    """``kernels._cos_sin_mod`` (the phase reduced into [-pi, pi), then cos.approx / sin.approx) against float64
    cos and sin of the same fp32 phases, over [0, 2 pi) (what the walk's unreduced sum reduces to) and over
    phases up to 1e4 (a long sequence's sum): within 2e-6 absolute. The reduction is exact to fp32's rounding
    of phi near 2 pi k: at |phi| = 1e4 one ulp of phi is 1e-3, which no cos / sin of that fp32 value can undo, so
    the large phases are compared with the float64 reduction of the same fp32 value."""
    import math

    import triton
    import triton.language as tl

    from nam_plugin_mimo_scan import kernels

    @triton.jit
    def both(x_ptr, cos_ptr, sin_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cos, sin = kernels._cos_sin_mod(tl.load(x_ptr + i, mask=i < n, other=0.0))
        tl.store(cos_ptr + i, cos, mask=i < n)
        tl.store(sin_ptr + i, sin, mask=i < n)

    gen = torch.Generator(device="cuda").manual_seed(5)
    small = torch.rand(1 << 18, device="cuda", generator=gen) * (2 * math.pi)
    large = (torch.rand(1 << 18, device="cuda", generator=gen) - 0.5) * 2e4
    x = torch.cat([small, large, torch.zeros(1, device="cuda")])
    cos, sin = torch.empty_like(x), torch.empty_like(x)
    both[(triton.cdiv(x.numel(), 1024),)](x, cos, sin, x.numel(), BLOCK=1024)
    red = torch.remainder(x.double(), 2 * math.pi)  # the exact reduction of each fp32 phase
    for name, ours, exact in (("cos", cos, torch.cos(red)), ("sin", sin, torch.sin(red))):
        err = (ours.double() - exact).abs()
        assert err[: small.numel()].max() <= 2e-6, f"{name} on [0, 2 pi): {err[: small.numel()].max():.2e}"
        # |phi| up to 1e4: the fp32 product 2 pi k in the reduction rounds by up to half an ulp of phi
        slack = (x.double().abs() * 2.0**-23).clamp(min=2e-6)
        assert (err <= slack + 2e-6).all(), f"{name}: {(err - slack).max():.2e} over"
    assert cos[-1].item() == 1.0 and sin[-1].item() == 0.0  # phase 0


def _inputs(b=1, l=256, h=16, g=2):
    from nam_plugin_mimo_scan.selftest import ACTIVATIONS, INPUT_NAMES, random_inputs

    x = random_inputs(b, l, h, g, N, P, R, device="cuda", seed=7)
    leaves = {k: (t.to(torch.bfloat16) if k in ACTIVATIONS else t).requires_grad_() for k, t in x.items()}
    args = [leaves[k] if k != "angles" else leaves[k].expand(b, l, h, -1) for k in INPUT_NAMES]
    return leaves, args


def test_forward_and_backward_make_no_host_sync():
    from nam_core.testing import no_host_sync
    from nam_plugin_mimo_scan.scan import mimo_scan

    leaves, args = _inputs()
    mimo_scan(*args).float().sum().backward()  # compile outside the checks
    torch.cuda.synchronize()
    with no_host_sync():
        torch.cuda.set_sync_debug_mode("error")
        try:
            mimo_scan(*args).float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves.values())


def test_forward_and_backward_capture_in_a_cuda_graph():
    """Capture forward + backward once (warmed up on a side stream: compile and autotune), replay, compare with
    an eager run: bit-identical, since no kernel uses atomics. The angles' expand is made inside the step:
    autograd runs each backward node on the stream of its forward, and an expand made once outside the capture
    put its backward (a sum over heads) on the legacy default stream, which ended the capture with
    cudaErrorStreamCaptureImplicit (the H200 run of 2026-11-25; the forward alone captured)."""
    from nam_plugin_mimo_scan.selftest import ACTIVATIONS, INPUT_NAMES, random_inputs
    from nam_plugin_mimo_scan.scan import mimo_scan

    b, l, h, g = 1, 256, 16, 2
    x = random_inputs(b, l, h, g, N, P, R, device="cuda", seed=7)
    leaves = {k: (t.to(torch.bfloat16) if k in ACTIVATIONS else t).requires_grad_() for k, t in x.items()}
    wrt = list(leaves.values())
    dout = torch.randn(b, l, h, P, device="cuda", dtype=torch.bfloat16)

    def step():
        args = [leaves[k] if k != "angles" else leaves[k].expand(b, l, h, -1) for k in INPUT_NAMES]
        return torch.autograd.grad(mimo_scan(*args), wrt, dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compile, autotune and warm up off the capture stream
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    graph.replay()
    torch.cuda.synchronize()
    for name, e, gr in zip(leaves, eager, static):
        assert torch.equal(e, gr), name


def test_kept_states_and_the_mamba_scan_replay_give_the_same_bits_in_bf16():
    """At NAM56R's widths in bf16 (h=128 in 8 groups, l=1000: a ragged last tile): the states kept from the
    forward (``keep_states=True``), and a call under nam's activation checkpoint whose replay asks
    ``for_backward_only`` (as the Mamba-3 mixer under ``train.recompute=mamba-scan``), give the output and every
    gradient of a plain call bit for bit: the kept states are the same kernel's on the same inputs."""
    from nam56r.recompute import checkpointed
    from nam_plugin_mimo_scan.scan import MimoScan, mimo_scan

    leaves, args = _inputs(l=1000, h=128, g=8)
    wrt = list(leaves.values())
    dout = torch.randn(1, 1000, 128, P, device="cuda", dtype=torch.bfloat16,
                       generator=torch.Generator(device="cuda").manual_seed(5))
    backend, passes = MimoScan(), []

    def between(*a):
        passes.append(None)
        fn = backend if len(passes) == 1 else backend.for_backward_only
        return fn(*a[:-1], chunk_size=16)

    runs = {"plain": lambda: mimo_scan(*args), "kept": lambda: mimo_scan(*args, keep_states=True),
            "replayed": lambda: checkpointed(between, None, *args)}
    results = {}
    for name, run in runs.items():
        out = run()
        results[name] = [out.detach(), *torch.autograd.grad(out, wrt, dout)]
    assert len(passes) == 2  # the first pass and the replay
    names = ["out", *leaves]
    for name in ("kept", "replayed"):
        differ = [n for n, a, b in zip(names, results[name], results["plain"]) if not torch.equal(a, b)]
        assert not differ, f"{name}: {differ}"


def test_the_first_call_autotunes_without_a_trace():
    """The first call of a new shape times several configs of some kernels; a timed run that adds into an
    output (the dk pass adds to d phase) must be undone (kernels.RESTORE), so the first call's gradients equal
    the second's bit for bit. Heads / groups no other test uses, so this call is the first of its shape."""
    leaves, args = _inputs(h=24, g=3)
    wrt = list(leaves.values())
    from nam_plugin_mimo_scan.scan import mimo_scan

    dout = torch.randn(1, 256, 24, P, device="cuda", dtype=torch.bfloat16)
    first = torch.autograd.grad(mimo_scan(*args), wrt, dout)
    second = torch.autograd.grad(mimo_scan(*args), wrt, dout)
    for name, a, b in zip(leaves, first, second):
        assert torch.equal(a, b), name


def test_preflight_launch_passes():
    import nam_plugin_mimo_scan.plugin as plugin
    from nam_core.checks import launch_rows

    [row] = launch_rows(plugin.NAME, plugin.PLUGIN, None)
    print(row.found)
    assert row.status == "pass", row
