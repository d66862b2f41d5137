"""The preflight launch check: compile and run Liger's kernels once, on a few tokens, against the reference.

A package that imports is not a kernel that runs: Triton compiles Liger's cross-entropy kernel for this
device on the first call, and a driver, Triton or architecture mismatch shows up only then. The check calls
the ``liger`` head exactly as training will (bf16, the formulation chosen for the installed release) and
compares the loss and both gradients with ``nam56r.reference.ce.ReferenceCEHead`` on the same inputs.
"""

from __future__ import annotations

from nam_core.checks import Measured

NAME = "liger"
CHECK = "fused CE launch"
TOKENS, HIDDEN, VOCAB = 64, 64, 512
"""A few tokens, a tiny vocabulary: the kernels compile in seconds and the numbers stay readable."""

MASKED = "dhidden on masked tokens"
TOLERANCE = 2e-2
"""Largest error of loss, dL/dhidden and dL/dW, relative to the largest reference value. bf16 inputs, fp32
reference math: Liger's bf16 logits matmul and bf16 gradient storage cost ~2^-8 relative, well under this;
a wrong kernel (no gradient, a wrong row) is off by order 1."""


NEEDED = (f"loss, dL/dhidden, dL/dW within {TOLERANCE:g} (relative) of the reference head and exactly 0 "
          f"dL/dhidden on masked tokens; bf16, {TOKENS} tokens x hidden {HIDDEN} x vocab {VOCAB}")
HINT = "python -m pytest plugins/nam-plugin-liger -m gpu -v shows the parity tests"


def launch(spec) -> Measured:
    """The liger head against the reference here (``PLUGIN.checks``: the host calls it on a real device). Liger is
    imported here first, before the engine's patch lane runs: its import entry is applied now."""
    from nam_plugin_liger import peft_probe

    peft_probe.apply_needed()
    try:
        errors, formulation, version = compare_with_reference()
    except Exception as e:  # a compile or launch failure of any kind is this check's failure, with its message
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Measured(False, f"it raised {type(e).__name__}: {first}",
                        hint="python -m pytest plugins/nam-plugin-liger -m gpu -v runs the same call with a traceback")
    from nam_plugin_liger.head import chunking

    found = ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + \
        f" ({formulation}, liger-kernel {version}; {chunking()})"
    ok = errors.pop(MASKED) == 0.0 and max(errors.values()) <= TOLERANCE
    return Measured(ok, found)


def compare_with_reference(device: str = "cuda") -> tuple[dict, str, str | None]:
    """Relative errors of the liger head against the reference on tiny random inputs, its formulation, version."""
    import torch

    from nam56r.reference.ce import ReferenceCEHead
    from nam_core.testing import max_rel_error
    from nam_plugin_liger.head import LigerCEHead, installed_version

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g).to(device, torch.bfloat16)  # [t, d]
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN**-0.5).to(device, torch.bfloat16)  # [v, d]
    target = torch.randint(0, VOCAB, (TOKENS,), generator=g).to(device)  # [t]
    mask = (torch.arange(TOKENS) % 4 != 0).float().to(device)  # [t]: every 4th token masked, token 0 too

    head = LigerCEHead()
    results = []
    for ce in (head, ReferenceCEHead()):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = ce(h, w, target, mask)  # [] fp32
        loss.backward()
        results.append((loss.detach().float(), h.grad.float(), w.grad.float()))
    (loss, dh, dw), (loss_ref, dh_ref, dw_ref) = results
    errors = {  # each inf where liger's value is not finite (a NaN would slip past a plain max)
        "loss": max_rel_error(loss, loss_ref),
        "dhidden": max_rel_error(dh, dh_ref),
        "dweight": max_rel_error(dw, dw_ref),
        MASKED: float(dh[mask == 0].abs().max() / dh_ref.abs().max()),  # exactly 0 if right (NaN fails == 0)
    }
    return errors, head.formulation, installed_version()
