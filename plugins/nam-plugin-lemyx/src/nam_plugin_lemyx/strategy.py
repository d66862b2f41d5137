"""The indexer strategy ``lemyx``: a fused dense warm-up for the first N steps, then a sparse strategy.

Warm-up (DeepSeek-V3.2's dense stage). For ``warmup_steps`` optimizer steps every DSA layer attends over
all past keys, and its lightning indexer learns the attention's distribution through the KL loss. Without
the plugin that is two passes: the attention core's dense attention, then a separate KL that materialises
index scores and the head-summed teacher as ``[b, s, s]`` fp32 tensors. Here one call produces both:

* ``backend="triton"`` (the default on CUDA): ``kernel.fused_warmup``, one fused Triton pass;
* ``backend="reference"`` (the default on CPU, or chosen by name anywhere): ``reference.warmup_reference``,
  the unfused pure-PyTorch path through the active attention core. It is the oracle of the kernel.

Hand-over. ``nam_before_step`` calls ``at_step(step)``; the first step at or past ``warmup_steps`` turns the
warm-up off for good (a resumed run past it starts sparse), and from then on ``select`` is the wrapped
sparse strategy's (``full``, or ``index-cache``), so DSA layers attend over their top-k keys and add the
sparse KL. The plugin logs the switch once.

The KL is added to the ForwardState as ``indexer_kl`` times the layer's ``indexer_loss_coeff``, the mean
over query rows, exactly as the dense warm-up of ``nam56r.blocks.dsa`` does; its teacher is detached, so it
trains the indexer only, while the attention output keeps training the main model (unless
``freeze_main``, which the plugin's step hook applies to the parameters).
"""

from __future__ import annotations

import torch
from torch import nn

from nam56r.state import ForwardState
from nam_core.options import parse_options
from nam_plugin_lemyx.options import (  # noqa: F401  (Options, options_for: the strategy's API, tests import them here)
    NAME, OPTIONS, TRITON, Options, options_for,
)
from nam_plugin_lemyx.reference import warmup_reference

class Lemyx:
    """Indexer strategy ``lemyx`` (a ``nam56r.backends.WarmupStrategy``) wrapping a sparse strategy."""

    name = NAME

    def __init__(self, sparse, options: Options = Options()):
        self.sparse = sparse
        """The strategy that picks top-k keys once the warm-up is over."""
        self.options = options
        self._warming = options.warmup_steps > 0
        self.handed_over_at: int | None = None
        self.announced = False

    @classmethod
    def build(cls, ctx) -> "Lemyx":
        """From the run (``nam56r.backends.BackendContext``): parsed options and the wrapped strategy built."""
        from nam56r.backends import build_backend

        options = options_for(ctx.options.get(NAME) or parse_options(NAME, OPTIONS, {}), ctx.device)
        inner = build_backend(ctx.registries["indexer"].get(options.sparse), ctx)
        if options.backend == TRITON:
            from nam_plugin_lemyx import kernel  # noqa: F401  (import errors surface at build, not mid-step)
        return cls(inner, options)

    @property
    def wrapped(self):
        """The backend this one wraps (``nam_core.run.StepContext.backends_of`` follows it)."""
        return self.sparse

    # --- lifecycle --------------------------------------------------------------------------------
    def warming_up(self) -> bool:
        return self._warming

    def at_step(self, step: int) -> bool:
        """Called before optimizer step ``step`` (0-based). True exactly once: when the warm-up ends here."""
        if self._warming and step >= self.options.warmup_steps:
            self._warming = False
            self.handed_over_at = step
            return True
        return False

    # --- the strategy -----------------------------------------------------------------------------
    def select(self, layer: nn.Module, x: torch.Tensor, qr: torch.Tensor, state: ForwardState | None):
        """After the warm-up: the wrapped strategy's selection (during it the layer calls ``attend_dense``)."""
        return self.sparse.select(layer, x, qr, state)

    def attend_dense(self, layer: nn.Module, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor,
                     qr: torch.Tensor, state: ForwardState | None) -> torch.Tensor:
        """Dense attention output ``[b, s, h, kv_lora]``; adds the indexer KL to ``state``."""
        iq, ik, w = layer.indexer.inputs(x, qr)  # [b, s, H, d], [b, s, d], [b, s, H] fp32
        if self.options.backend == TRITON:
            from nam_plugin_lemyx.kernel import fused_warmup

            o, kl = fused_warmup(q, kv, iq, ik, w, scale=layer.softmax_scale, d_v=layer.kv_lora)
        else:
            o, kl = warmup_reference(q, kv, iq, ik, w, scale=layer.softmax_scale, d_v=layer.kv_lora,
                                     target=self.options.target, attention=layer.attention)
        if state is not None:
            state.add_loss("indexer_kl", kl.mean() * layer.cfg.indexer_loss_coeff)
        return o

    def describe(self) -> str:
        """One line for preflight and the run log."""
        o = self.options
        path = ("fused Triton kernel (dense attention + indexer KL in one pass)" if o.backend == TRITON
                else "reference path (unfused pure PyTorch: dense attention, then the KL)")
        freeze = "; main model frozen" if o.freeze_main else ""
        return (f"indexer warm-up for {o.warmup_steps} steps on the {path}, backend {o.backend} "
                f"({o.backend_source}), target {o.target}{freeze}; then sparse with indexer '{o.sparse}'")
