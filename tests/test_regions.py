"""Compiled regions (nam56r/regions.py, the model's ``compile_glue``): each region under inductor against its eager
function on fresh random inputs, forward and backward, fp32 and bf16; the one error when inductor cannot build.

Tolerances (compiled against eager, the same inputs): fp32 ``rtol = atol = 1e-5`` (the two differ in the order of
fp32 additions and in exp's last bits: ~1e-7 measured); bf16 relative L2 error below ``2**-7`` (eager rounds each
intermediate to bf16, inductor keeps them in fp32 and rounds once: ~3e-3 measured). A region that dropped a term
(the gate, one of a token's rows) is off by O(1). Tiny shapes: each test compiles in a few seconds on the CPU."""

from __future__ import annotations

import pytest
import torch

from nam56r.experts import COMPILED_ROWS, EAGER_ROWS, gather_sum, gated_swiglu
from nam56r.regions import Region, require_inductor
from nam_core.errors import CannotRunHere
from nam_core.testing import new_seed, rel_norm_error

BF16_REL = 2**-7


def assert_near(got: torch.Tensor, want: torch.Tensor, seed: int) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, seed
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    else:
        err = rel_norm_error(got, want)
        assert err < BF16_REL, (err, seed)


def _rows(seed: int, dtype, t=24, k=3, d=40):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(t * k, d, generator=gen).to(dtype)
    index = torch.randperm(t * k, generator=gen)  # each sorted row read once, as a routing's slots are
    return rows, index, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_sum_compiled_equals_eager_and_the_definition(dtype):
    seed = new_seed()
    rows, index, k = _rows(seed, dtype)
    got = COMPILED_ROWS.gather_sum(rows, index, k)
    assert_near(got, gather_sum(rows, index, k), seed)
    want = torch.stack([rows.double()[index[i * k:(i + 1) * k]].sum(0) for i in range(index.numel() // k)])
    assert_near(got.double().to(dtype), want.to(dtype), seed)  # out[i] = sum_j rows[index[i k + j]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_swiglu_compiled_equals_eager_forward_and_backward(dtype):
    seed = new_seed()
    gen = torch.Generator().manual_seed(seed)
    r, f = 48, 24
    h = torch.randn(r, 2 * f, generator=gen).to(dtype)
    gates = torch.rand(r, generator=gen).to(dtype)
    dy = torch.randn(r, f, generator=gen).to(dtype)

    def run(fn):
        hh, gg = h.clone().requires_grad_(), gates.clone().requires_grad_()
        y = fn(hh, gg)
        y.backward(dy)
        return y.detach(), hh.grad, gg.grad

    for got, want in zip(run(Region(gated_swiglu, "compile_glue")), run(gated_swiglu), strict=True):
        assert_near(got, want, seed)


def test_a_region_compiles_once_per_shape_without_graph_breaks():
    """``dynamic=False``: one graph a shape, built at the shape's first call and reused after (the count of graphs
    dynamo built: 1 after two calls at one shape, 2 after a call at another); ``fullgraph=True``: a graph break
    raises instead of running part of the region eagerly."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()

    def scaled(x):
        return x * 2.0 + 1.0

    region = Region(scaled, "compile_glue")
    built = []
    for n in (5, 5, 7):
        x = torch.randn(n)
        assert torch.equal(region(x), scaled(x))
        built.append(counters["stats"]["unique_graphs"])
    assert built == [1, 1, 2]

    torch._dynamo.reset()

    def breaks(x):
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(Exception, match="graph_break|Graph break|graph break"):
        Region(breaks, "compile_glue")(torch.zeros(2))


def test_missing_inductor_is_one_error_naming_the_setting(monkeypatch):
    import torch._inductor.cpp_builder as cpp_builder
    import torch.utils._triton as triton_utils

    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    region = Region(gather_sum, "compile_glue")
    with pytest.raises(CannotRunHere, match=r"compile_glue=true .*found no C\+\+ compiler") as err:
        region(*_rows(1, torch.float32))
    assert err.value.hint.startswith("--set compile_glue=false") and region._compiled is None  # nothing built
    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    with pytest.raises(CannotRunHere, match="no working Triton for this GPU"):
        require_inductor("cuda", "compile_glue")


def test_the_eager_rows_are_the_plain_functions():
    """compile_glue off runs exactly the functions above, no compile."""
    assert EAGER_ROWS.gather_sum is gather_sum and EAGER_ROWS.gated_swiglu is gated_swiglu
    assert isinstance(COMPILED_ROWS.gather_sum, Region) and COMPILED_ROWS.gather_sum.fn is gather_sum
    assert COMPILED_ROWS.gated_swiglu is gated_swiglu  # compiled it measured 0.47x of eager (glue.md)
