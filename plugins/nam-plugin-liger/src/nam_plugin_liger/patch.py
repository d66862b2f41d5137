"""Patch-lane entry ``liger-none-reduction-bwd``: Liger issue #968, fixed in liger-kernel 0.8.2 (PR #1298).

The bug. Before 0.8.2, ``LigerFusedLinearCrossEntropyFunction`` computes its gradients in forward for every
reduction, and backward scales them with ``element_mul_kernel``, which reads one scalar: ``grad_output[0]``.
With ``reduction="none"`` the upstream gradient is per token, so every row is scaled by the first token's.
For the masked loss ``sum_t mask_t * CE_t`` that means all-zero gradients when the first token is masked
(its target ignored), and gradient on masked tokens when their targets are kept; 0.8.2 recomputes the logits
in backward and folds the per-token gradient into each row (kernels-and-math.md section 7).

Detection is a version check: the fix is release-gated, and nothing short of launching the kernels tells
the two apart, so ``detect()`` reads the installed version (``< 0.8.2``: affected) and ``reproduce()`` is
the launch that proves it (``nam patches --plugins liger --verify`` on a GPU, and the GPU tests).

The workaround (``apply``) switches the ``liger`` head to ``reduction="mean"`` over the live tokens times the
live-token count, exact for a 0/1 mask (``nam_plugin_liger.head``). On 0.8.2 and later the patch reports
``retired``. The plugin's package requirement is ``liger-kernel>=0.8.0``, so an affected release (0.8.0,
0.8.1) activates and the patch lane applies the workaround before the head is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from nam_core.patches import BUG_REPRODUCED, FIX_VALIDATED, Patch
from nam_plugin_liger import head

NAME = "liger-none-reduction-bwd"
RETIRE_WHEN = "liger-kernel 0.8.2 (PR #1298, commit 9ac26bb8); delete once every host runs >= 0.8.2"

TOLERANCE = 5e-2
"""Largest input-gradient error, relative to the largest reference gradient, still counted as correct.

The bug's errors are of order 1 (every gradient zero, or masked rows as large as live ones); fp32 rounding
of the fix is ~1e-6 relative. Measured on an H100: 1.0 in both cases with liger-kernel 0.8.1, 6.8e-7 with
0.8.5. Any threshold in between separates them; 5e-2 leaves room for TF32."""


def detect() -> bool:
    """Bug present in this process: an affected release is installed and the workaround is not on."""
    version = head.installed_version()
    return version is not None and head.has_none_reduction_bug(version) and not head.mean_workaround_enabled()


def apply() -> None:
    head.enable_mean_workaround()


@dataclass(frozen=True)
class Reproduction:
    """What the reproducer measured: one line per masking case and the verdict."""

    verdict: str
    """BUG_REPRODUCED or FIX_VALIDATED."""
    errors: dict
    """Case -> max |dL/dhidden - reference| / max |reference|."""

    def describe(self) -> str:
        cases = ", ".join(f"{case}: {err:.1e}" for case, err in self.errors.items())
        return f"{self.verdict} (input-gradient error vs the reference head, tolerance {TOLERANCE:g}: {cases})"


def run_reproducer(flce=None, device: str = "cuda", dtype=None) -> Reproduction:
    """Masked loss through ``reduction="none"`` times the mask, against the chunked fp32 reference head.

    Two cases of ``sum_t mask_t * CE_t / sum_t mask_t`` (the model's LM loss), 256 tokens, hidden 128,
    vocab 1024, a 0/1 mask with a quarter of tokens masked:

    * ``first-masked``: the liger head's own call (masked targets set to ``ignore_index``) with token 0
      masked. Affected releases return all-zero input gradients.
    * ``targets-kept``: masked targets left in place, token 0 live (the plain ``loss_1d * mask`` pattern).
      Affected releases give masked tokens the gradient of live ones.

    ``flce`` defaults to Liger's function; CPU tests pass pure-torch stand-ins, with and without the bug.
    """
    import torch

    from nam56r.reference.ce import ReferenceCEHead
    from nam_core.testing import max_rel_error

    flce = flce if flce is not None else head.liger_flce()
    dtype = dtype if dtype is not None else torch.float32
    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the reference accumulates in it
    g = torch.Generator().manual_seed(968)
    t, d, v = 256, 128, 1024
    hidden = torch.randn(t, d, generator=g, dtype=torch.float64)  # [t, d]
    weight = torch.randn(v, d, generator=g, dtype=torch.float64) * d**-0.5  # [v, d]
    target = torch.randint(0, v, (t,), generator=g)  # [t]
    mask = (torch.rand(t, generator=g) > 0.25).to(torch.float64)  # [t] 0/1

    errors = {}
    for case in ("first-masked", "targets-kept"):
        m = mask.clone()
        m[0] = 0.0 if case == "first-masked" else 1.0
        y = torch.where(m != 0, target, head.IGNORE_INDEX) if case == "first-masked" else target
        # Copies (``.to`` returns the tensor itself when nothing changes): each run owns its ``.grad``.
        h = hidden.to(device, dtype, copy=True).requires_grad_()
        w = weight.to(device, dtype, copy=True).requires_grad_()  # as in training: dL/dW is accumulated too
        per_token = flce(h, w, y.to(device), "none")  # [t] fp32
        md = m.to(device)
        ((per_token.double() * md).sum() / md.sum()).backward()

        h_ref = hidden.to(device, ref_dtype, copy=True).requires_grad_()
        ref = ReferenceCEHead()(h_ref, weight.to(device, ref_dtype), target.to(device), md.to(ref_dtype))
        (ref / md.sum()).backward()
        errors[case] = max_rel_error(h.grad, h_ref.grad)  # inf where a gradient is not finite: never validated
    verdict = BUG_REPRODUCED if max(errors.values()) > TOLERANCE else FIX_VALIDATED
    return Reproduction(verdict, errors)


def reproduce() -> str:
    """``Patch.reproduce``: run the reproducer with the installed Liger on the GPU."""
    return run_reproducer().verdict


def make_patch() -> Patch:
    return Patch(
        name=NAME,
        target=head.DISTRIBUTION,
        versions=head.AFFECTED,
        summary="FLCE reduction='none' backward scales every row by grad_output[0] (Liger #968); the liger "
                "head uses reduction='mean' over live tokens x live count instead (exact for a 0/1 mask)",
        retire_when=RETIRE_WHEN,
        detect=detect,
        apply=apply,
        reproduce=reproduce,
        needs_gpu=True,
    )
