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

from dataclasses import dataclass

import torch
from torch import nn

from nam56r.state import ForwardState
from nam_plugin_lemyx.reference import HEAD_SUM, TARGETS, warmup_reference

NAME = "lemyx"
TRITON, REFERENCE = "triton", "reference"
BACKENDS = (TRITON, REFERENCE)
DEFAULT_WARMUP_STEPS = 1000
"""DeepSeek-V3.2 trains the indexer densely for its first 1000 steps."""


@dataclass(frozen=True)
class Options:
    """``lemyx.*`` options after parsing; ``backend`` already resolved for the device."""

    warmup_steps: int = DEFAULT_WARMUP_STEPS
    backend: str = REFERENCE
    backend_source: str = "default for cpu"
    target: str = HEAD_SUM
    freeze_main: bool = False
    sparse: str = "full"


def options_for(values, device: str) -> Options:
    """The host-parsed ``lemyx.*`` values (``nam_core.options.OptionValues``) with the backend resolved for
    ``device`` (``cpu`` or ``cuda``): never chosen by what is installed; unset, it is ``reference`` on a CPU
    device and ``triton`` on a CUDA device (whether the kernel can run there is the config check's business)."""
    if values.backend is not None:
        backend, source = values.backend, "set by you"
    else:
        backend, source = (TRITON if device == "cuda" else REFERENCE), f"default for {device}"
    return Options(warmup_steps=values.warmup_steps, backend=backend, backend_source=source, target=values.target,
                   freeze_main=values.freeze_main, sparse=values.sparse)


def option_problem(options: Options) -> tuple[str, str, str] | None:
    """``(option, found, expected)`` for a combination of options that cannot run, or None."""
    if options.sparse == NAME:
        return f"{NAME}.sparse", options.sparse, "another indexer strategy (full, index-cache, ...)"
    if options.backend == TRITON and options.target != HEAD_SUM:
        return (f"{NAME}.target", options.target,
                f"{HEAD_SUM} with the fused kernel (per-head runs on {NAME}.backend={REFERENCE} only)")
    return None


def shape_problem(dk: int, dv: int, di: int) -> str | None:
    """Why the fused kernel cannot take these head widths, or None (MLA key/value width, indexer head dim)."""
    for name, d in (("MLA key width (kv_lora_rank + qk_rope_dim)", dk), ("MLA value width (kv_lora_rank)", dv),
                    ("indexer head dim", di)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"{name} {d} (the kernel takes powers of two from 16 to 256)"
    if dv > dk:
        return f"value width {dv} wider than key width {dk}"
    return None


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
        from nam_plugin_lemyx.plugin import PLUGIN

        options = options_for(ctx.options.get(NAME) or PLUGIN.parse_options(NAME), ctx.device)
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
