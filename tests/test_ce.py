"""Reference CE head: float64 parity with F.cross_entropy, and no [t, vocab] buffer when chunked."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nam56r.backends import CEHead
from nam56r.reference.ce import ReferenceCEHead


def inputs(t: int, v: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, d, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, d, dtype=torch.float64, generator=g, requires_grad=True)
    target = torch.randint(0, v, (t,), generator=g)
    mask = torch.randint(0, 2, (t,), generator=g).double()
    return hidden, weight, target, mask


def dense_loss(hidden, weight, target, mask):
    return (F.cross_entropy(hidden @ weight.T, target, reduction="none") * mask).sum()


@pytest.mark.parametrize("t,chunk", [(37, 16), (32, 8), (5, 1024)])  # ragged last chunk, even, one chunk
def test_value_and_grads_match_dense_cross_entropy(t, chunk):
    hidden, weight, target, mask = inputs(t, v=50, d=8)
    target[mask == 0] = -100  # masked targets are placeholders and must never be read
    loss = ReferenceCEHead(chunk)(hidden, weight, target, mask)
    gh, gw = torch.autograd.grad(2.5 * loss, (hidden, weight))  # a non-unit upstream grad

    ref = dense_loss(hidden, weight, target.clamp(min=0), mask)
    rh, rw = torch.autograd.grad(2.5 * ref, (hidden, weight))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-12, atol=1e-12)
    assert gh[mask == 0].abs().max() == 0  # masked tokens get no gradient


def test_bf16_inputs_return_fp32_loss_and_input_dtype_grads():
    hidden, weight, target, mask = inputs(9, v=20, d=4)
    h, w = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    loss = ReferenceCEHead(4)(h, w, target, mask)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    ref = dense_loss(h.double(), w.double(), target, mask)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any op produces while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def test_no_full_logits_when_chunked():
    t, v, d, chunk = 64, 50, 8, 16  # t * v = 3200; one chunk of logits = 800; dW = 400; dh = 512
    hidden, weight, target, mask = inputs(t, v, d)

    with LargestOutput() as dense:  # the recorder sees the full logits of the unchunked loss
        dense_loss(hidden, weight, target, mask).backward()
    assert dense.largest >= t * v

    with LargestOutput() as chunked:
        ReferenceCEHead(chunk)(hidden, weight, target, mask).backward()
    assert chunked.largest <= chunk * v < t * v


def test_no_grad_skips_gradient_work_and_head_satisfies_protocol():
    hidden, weight, target, mask = inputs(7, v=11, d=3)
    with torch.no_grad():
        loss = ReferenceCEHead(4)(hidden, weight, target, mask)
    torch.testing.assert_close(loss, dense_loss(hidden, weight, target, mask).detach(), rtol=1e-12, atol=0)
    assert isinstance(ReferenceCEHead(), CEHead)
