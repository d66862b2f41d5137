"""The gradient-parity self-test the plugin runs before it activates, and the GPU tests run at larger sizes.

It reproduces what the model does with a CE head: three calls sharing one weight (the LM head and both MTP
depths), each with its own hidden states, targets and 0/1 mask (a quarter of tokens masked, token 0 always,
their targets set to the placeholder -100 that must never be read), summed and divided by the live-token
count, bf16 inputs. The reference is ``ReferenceCEHead`` in fp32 on the same bf16 values. Errors are
``max |head - reference| / max |reference|`` for the loss, every call's dL/dhidden and the shared dL/dW; the
largest |dL/dhidden| on masked tokens must be exactly 0; any non-finite value fails.
"""

from __future__ import annotations


import torch

from nam_core.checks import Measured
from nam_core.testing import max_rel_error, new_seed

TOLERANCE = 2e-2
"""bf16 inputs and a bf16 logits gradient (~2^-8 relative per element) against fp32 math; a wrong row, a
missing gradient or a NaN is off by order 1 or more."""

PLACEHOLDER = -100




def compare(head, *, tokens: int = 300, hidden: int = 256, vocab: int = 1000, calls: int = 3, device="cuda",
            dtype=torch.bfloat16, seed: int | None = None) -> dict:
    """Errors of ``head`` against the reference (module docstring) plus ``seed`` and ``masked_dh``."""
    from nam56r.reference.ce import ReferenceCEHead

    seed = new_seed() if seed is None else seed
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(device, dtype)
    inputs = []
    for _ in range(calls):
        h = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        mask = (torch.rand(tokens, generator=g) > 0.25).float()
        mask[0] = 0.0
        target = torch.randint(0, vocab, (tokens,), generator=g)
        target = torch.where(mask != 0, target, PLACEHOLDER)
        inputs.append((h, target.to(device), mask.to(device)))

    def run(ce, work_dtype):
        w = weight.to(work_dtype, copy=True).requires_grad_()
        hs = [h.to(work_dtype, copy=True).requires_grad_() for h, _, _ in inputs]
        total = sum(ce(h, w, y, m) for h, (_, y, m) in zip(hs, inputs))
        live = sum(m.sum() for _, _, m in inputs)
        loss = total / live
        loss.backward()
        return loss.detach(), [h.grad for h in hs], w.grad

    loss, dhs, dw = run(head, dtype)
    ref_loss, ref_dhs, ref_dw = run(ReferenceCEHead(), torch.float32)
    errors = {"loss": max_rel_error(loss, ref_loss), "dhidden": max(max_rel_error(a, r) for a, r in zip(dhs, ref_dhs)),
              "dweight": max_rel_error(dw, ref_dw)}
    masked = max(dh[m == 0].abs().max().item() for dh, (_, _, m) in zip(dhs, inputs))
    return {**errors, "masked_dh": masked, "seed": seed}


def passed(result: dict) -> bool:
    return result["masked_dh"] == 0.0 and all(result[k] <= TOLERANCE for k in ("loss", "dhidden", "dweight"))


def launch(spec) -> Measured:
    """The activation self-test on a real CUDA device (``PLUGIN.checks``; the host skips it on fakes and CPUs)."""
    from nam_plugin_hopper_ce.head import HopperCEHead
    from nam_plugin_hopper_ce.plugin import NAME

    needed = (f"loss, every dL/dhidden and the shared dL/dW within {TOLERANCE:g} of the reference head, "
              "0 on masked tokens, all finite (3 heads sharing one weight, bf16)")
    options = None if spec is None else spec.options.get(NAME)
    head = HopperCEHead(chunk_tokens=128, **({} if options is None else {"gradients": options.gradients}))
    r = compare(head, device="cuda")  # the path the run's steps take
    found = (f"loss {r['loss']:.1e}, dhidden {r['dhidden']:.1e}, dweight {r['dweight']:.1e}, masked dh "
             f"{r['masked_dh']:g} (300 tokens x 256 x vocab 1000, chunks of 128, gradients in {head.gradients}; "
             f"seed {r['seed']})")
    return Measured(passed(r), found, needed)
