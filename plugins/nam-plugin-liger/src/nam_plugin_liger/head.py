"""The ``liger`` CE head: NAM56R's LM head and MTP heads through Liger-Kernel's fused linear cross-entropy.

Liger (kernels-and-math.md section 7) projects ``hidden`` onto the vocabulary a chunk of tokens at a time and
turns each chunk into losses and gradients with one Triton kernel: at NAM56R's head (8192 tokens x 4096 x
131072) a chunk is 1024 tokens, a [1024, 131072] bf16 logits buffer of 256 MiB (``CHUNK_MEM_CONST``; 256
tokens on releases without that knob). No [tokens, vocab] logits tensor ever exists, in bf16 or in fp32.

Which Liger call gives the CEHead contract ``sum_t mask_t * CE_t`` exactly, and why this one:

* ``NONE_TIMES_MASK`` (used on every release >= 0.8.2): ``reduction="none"`` gives per-token losses [t] in
  fp32; the head multiplies them by the mask and sums. Backward hands Liger a per-token upstream gradient
  ``mask_t * g``, and since 0.8.2 (PR #1298) Liger folds it into each row of the logits gradient *before*
  the sums into dL/dW, so both gradients are exact for any per-token weight, the reference head's
  semantics. ``accum_dtype=torch.float32`` keeps dL/dW's sum over tokens in fp32. Cost: Liger recomputes the
  chunked logits in backward (one more [t, d] x [d, v] matmul: 64 ms forward + backward against 49 ms for
  the call below, H100, liger-kernel 0.8.5) but keeps nothing from forward to backward but its inputs.
* ``reduction="sum"`` with ``ignore_index`` on masked tokens is exact too, and needs no recompute, but only
  for a 0/1 mask (a weight would be silently read as 1), and its compute-in-forward path holds dL/dhidden
  [t, d] and dL/dW [v, d] (1 GiB in bf16 for NAM56R, per head call: main + 2 MTP) from the head's forward
  until the whole model's backward reaches it. Not used.
* ``MEAN_TIMES_LIVE``, the patch lane's workaround for releases < 0.8.2 only (Liger issue #968: there,
  ``reduction="none"`` backward scales every row by the *first* token's upstream gradient, so a 0/1 mask
  whose first token is 0 zeroes every gradient, and a weighted mask is wrong). ``reduction="mean"`` over the
  live tokens times the live-token count: that release's mean path takes one scalar upstream gradient,
  which it handles correctly, so this is exact for a 0/1 mask; the head refuses any other mask here.

Both formulations give masked tokens Liger's ``ignore_index``: their targets may be placeholders (-1, -100, a
token of another document) that the kernel would otherwise read as vocabulary ids, and an ignored row's loss
and logits-gradient row are zeroed inside the kernel, so a token with mask 0 gets exactly zero gradient.

The head never picks a formulation by itself on a buggy release: ``NONE_TIMES_MASK`` there raises, and only
the patch (``nam_plugin_liger.patch``, applied by the engine after activation) turns the workaround on.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Callable

import torch

from nam_core.errors import CannotRunHere, NamError
from nam_core.requirements import version_in

DISTRIBUTION = "liger-kernel"
FIXED_IN = "0.8.2"
FLOOR = "0.8.0"
"""The oldest release the plugin accepts (PluginInfo.requires): 0.8.0 and 0.8.1 run through the patch lane."""
"""First release whose ``reduction="none"`` backward is right (PR #1298, commit 9ac26bb8)."""
AFFECTED = f"<{FIXED_IN}"
"""Releases with Liger issue #968 (reduction="none" backward uses only ``grad_output[0]``)."""
INSTALL_HINT = "pip install nam-plugin-liger[gpu]"

CHUNK_MEM_CONST = 4
"""Liger's transient-logits budget, in units of ``t x d`` elements (its default is 1), where the release takes it.

At NAM56R's head (8192 tokens x 4096 x 131072, bf16, H100) the default makes 256-token chunks, and reading and
writing the 2 GiB fp32 dL/dW once per chunk dominates: 117 ms forward + backward. 4 makes 1024-token chunks
(a [1024, 131072] bf16 logits buffer, 256 MiB, the reference head's chunk): 64 ms, same 3.06 GiB peak; 8
gives 61 ms for 512 MiB (measured with liger-kernel 0.8.5, bench/liger.py). Releases before 0.8.3 do not take it
(0.8.3 and 0.8.4 read: they do; 0.8.2 does not): they run the 256-token chunks, which the preflight launch row says
(``chunking``), not silently."""


def _takes_chunk_mem_const(forward_signature: inspect.Signature) -> bool:
    return "chunk_mem_const" in forward_signature.parameters


def chunking() -> str:
    """How the installed Liger chunks NAM56R's head: the row text of the preflight launch check."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    if _takes_chunk_mem_const(inspect.signature(LigerFusedLinearCrossEntropyFunction.forward)):
        return f"chunk_mem_const={CHUNK_MEM_CONST}: 1024-token chunks at NAM56R's head"
    return ("256-token chunks: this release takes no chunk_mem_const (~117 ms a NAM56R head call against ~64 with "
            "it; liger-kernel >= 0.8.3 takes it)")

IGNORE_INDEX = -100
"""Liger's default ``ignore_index``; masked tokens get it (a vocabulary id is never negative)."""

NONE_TIMES_MASK = "none*mask"
MEAN_TIMES_LIVE = "mean*live"
FORMULATIONS = (NONE_TIMES_MASK, MEAN_TIMES_LIVE)

FusedLinearCE = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, str], torch.Tensor]
"""``flce(hidden [t, d], weight [v, d], target [t] with IGNORE_INDEX, reduction) -> loss`` (fp32): Liger's
function, or a pure-torch stand-in in CPU tests."""

_mean_workaround = False
"""Set by the patch lane (``enable_mean_workaround``) when the installed Liger has issue #968."""


# --- the installed release and the patch lane's switch -------------------------------------------
def installed_version() -> str | None:
    """The installed liger-kernel version, or None."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def has_none_reduction_bug(version: str) -> bool:
    """True for releases with Liger issue #968. Release-gated: the fix has no feature to probe for."""
    return version_in(version, AFFECTED)


def enable_mean_workaround() -> None:
    """The patch's ``apply``: heads resolved from now on use ``MEAN_TIMES_LIVE``. Idempotent."""
    global _mean_workaround
    _mean_workaround = True


def mean_workaround_enabled() -> bool:
    return _mean_workaround


def reset_workaround() -> None:
    """Back to no workaround (tests: one process activates many times)."""
    global _mean_workaround
    _mean_workaround = False


def formulation_for(version: str | None) -> str:
    """The formulation that is exact with ``version`` of liger-kernel; raises where none is allowed yet."""
    if version is None:
        raise CannotRunHere(f"the liger CE head needs {DISTRIBUTION}>={FLOOR}; found it not installed",
                       hint=INSTALL_HINT)
    if not has_none_reduction_bug(version):
        return NONE_TIMES_MASK
    if _mean_workaround:
        return MEAN_TIMES_LIVE
    raise CannotRunHere(
        f"{DISTRIBUTION} {version} has the reduction='none' backward bug (Liger issue #968, fixed in "
        f"{FIXED_IN}) and the patch lane has not switched the liger head to its workaround",
        hint=f"upgrade: {INSTALL_HINT}; or activate through nam (`nam train --plugins liger`), which applies "
             "the patch (`nam patches --plugins liger` shows it)",
    )


# --- Liger's function --------------------------------------------------------------------------
def liger_flce() -> FusedLinearCE:
    """Liger's fused linear CE as a ``FusedLinearCE``; a NamError with the install hint when it is absent."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    except ImportError as e:
        raise CannotRunHere(f"the liger CE head needs {DISTRIBUTION}>={FLOOR}; importing it failed: {e}",
                       hint=INSTALL_HINT) from None
    signature = inspect.signature(LigerFusedLinearCrossEntropyFunction.forward)
    options = dict(
        ignore_index=IGNORE_INDEX,
        accum_dtype=torch.float32,  # dL/dW summed over chunks in fp32, cast to the weight's dtype at the end
    )
    if _takes_chunk_mem_const(signature):  # 0.8.3 and newer (``chunking`` says which ran)
        options["chunk_mem_const"] = CHUNK_MEM_CONST

    def flce(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, reduction: str) -> torch.Tensor:
        # autograd.Function.apply takes positions: bind by name against this release's forward, so the
        # defaults (no bias, no z-loss, no label smoothing, no softcap) come from Liger itself.
        bound = signature.bind(None, hidden, weight, target, reduction=reduction, **options)  # None: ctx
        bound.apply_defaults()
        out = LigerFusedLinearCrossEntropyFunction.apply(*bound.args[1:])
        return out[0]  # (loss, z_loss, token_accuracy[, predicted_tokens]): older releases return 3 values

    return flce


# --- the head ----------------------------------------------------------------------------------
def masked_sum(
    flce: FusedLinearCE, formulation: str, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """``sum_t mask_t * CE(hidden_t W^T, target_t)`` as an fp32 scalar, through ``flce`` (module docstring)."""
    live = mask != 0  # [t] bool
    target = torch.where(live, target, IGNORE_INDEX)  # [t]: placeholders at masked tokens are never read
    if formulation == NONE_TIMES_MASK:
        per_token = flce(hidden, weight, target, "none")  # [t] fp32, 0 at ignored tokens
        return (per_token.float() * mask.float()).sum()
    if formulation == MEAN_TIMES_LIVE:
        # Liger reads its live count on the host anyway (.item() in its forward); one more read here keeps a
        # weighted mask from being silently treated as 0/1.
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"formulation {MEAN_TIMES_LIVE} is exact for a 0/1 mask only; found other values "
                             f"in mask (dtype {mask.dtype}); upgrade: {INSTALL_HINT} ({NONE_TIMES_MASK} takes "
                             "any per-token weight)")
        n_live = live.sum().float()  # [] on the device: no host read
        # reduction="mean" is sum / n_live (0, not NaN, when no token is live: every row is ignored).
        return flce(hidden, weight, target, "mean").float() * n_live
    raise ValueError(f"formulation must be one of {FORMULATIONS}, found {formulation!r}")


class LigerCEHead:
    """``CEHead`` (nam56r/backends.py) through Liger-Kernel: see the module docstring.

    The registry instantiates it with no arguments: Liger's function is imported and the formulation chosen
    (from the installed release and the patch lane) at the first call. Tests pass ``flce`` (a pure-torch
    stand-in) and ``formulation`` to check the math on the CPU.
    """

    def __init__(self, formulation: str | None = None, flce: FusedLinearCE | None = None):
        if formulation is not None and formulation not in FORMULATIONS:
            raise ValueError(f"formulation must be one of {FORMULATIONS}, found {formulation!r}")
        self._formulation = formulation
        self._flce = flce

    @property
    def formulation(self) -> str:
        if self._formulation is None:
            self._formulation = formulation_for(installed_version())
        return self._formulation

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if self._flce is None:
            if not (hidden.is_cuda and weight.is_cuda):
                raise NamError(
                    f"the liger CE head runs Triton kernels on CUDA tensors; found hidden on {hidden.device} "
                    f"and weight on {weight.device}",
                    hint="train on a GPU (--device cuda), or use the reference head: --set ce_backend=reference "
                         "--plugins reference",
                )
            self._flce = liger_flce()
        if hidden.dtype != weight.dtype:  # Liger's matmul takes one dtype; a cast here would drop precision unsaid
            raise NamError(f"the liger CE head takes hidden and weight of one dtype; found {hidden.dtype} and "
                           f"{weight.dtype}", hint="--set train.dtype=bfloat16 (the model's hidden and weights in it)")
        return masked_sum(self._flce, self.formulation, hidden, weight, target, mask)
