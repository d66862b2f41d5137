"""What a backend of each kind (nam56r/kinds.py) must provide.

Blocks own parameters and projections; a backend owns only the hot core of a block (the Mamba-3 scan, the
attention over a latent KV, the LM head + cross-entropy, the DSA top-k selection). The reference plugin
(``nam56r/reference``) implements every protocol in pure PyTorch; GPU plugins implement the same calls with
kernels and are tested against the reference.

Registries hold *classes*; the engine builds one object per backend name (``build_backend``) and the model
hands it to every block that needs it. A class with a ``build(ctx: BackendContext)`` classmethod is built
from the model config, the plugin options and the device; any other class is called with no arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from nam56r.config import NAM56RConfig
    from nam56r.state import ForwardState


@dataclass(frozen=True)
class BackendContext:
    """What a backend class may read when it is built (``cls.build(ctx)``)."""

    model: NAM56RConfig
    options: Mapping[str, Any] = field(default_factory=dict)
    """Plugin -> its parsed options (``nam_core.options.OptionValues``: ``ctx.options[<plugin>].warmup_steps``),
    for the requested plugins; a backend built without a run (tests) finds no entry and uses its defaults."""
    registries: Mapping[str, Any] = field(default_factory=dict)
    """The active registries by kind, for a backend that wraps another (a warm-up strategy runs the one it wraps after its warm-up)."""
    device: str = "cpu"
    """``train.device``: ``cpu`` or ``cuda``."""


def build_backend(cls: type, ctx: BackendContext) -> Any:
    """``cls.build(ctx)`` when the class defines it, else ``cls()``."""
    build = getattr(cls, "build", None)
    return build(ctx) if build is not None else cls()


@runtime_checkable
class SSMScan(Protocol):
    """Kind ``ssm``: the Mamba-3 chunked scan (the math of kernels-and-math.md section 1.2).

    Shapes follow mamba-ssm's MIMO kernel so a kernel backend is a thin call::

        q, k     [b, l, r, g, n]   C (query) and B (key) after BC-norm, before bias and rotation
        v, z     [b, l, h, p]      x and the gate input
        adt, dt  [b, h, l]         A*dt and dt, fp32
        trap     [b, h, l]         trapezoid mix, PRE-sigmoid
        q_bias, k_bias [h, r, n]   fp32
        angles   [b, l, h, s]      raw angles (the scan applies pi*tanh, * dt, cumsum)
        d        [h]               skip, fp32
        mimo_x, mimo_z, mimo_o [h, r, p]   MIMO projections; None when r == 1 (SISO)
        returns  [b, l, h, p]      gated output, ready for out_proj

    Rotation convention: SISO (r == 1) rotates adjacent pairs (2i, 2i+1); MIMO rotates (i, i + n/2),
    matching mamba-ssm's Triton SISO and TileLang MIMO kernels respectively.

    Optional: ``for_backward_only(...)``, the same arguments: the same autograd graph and saved tensors as a
    call, the result's values unspecified. ``train.recompute=mamba-scan`` replays the scan only to rebuild
    what its backward reads and drops the result (``nam56r.blocks.mamba3``); a backend whose backward does not
    read its own output can skip the forward's work there.
    """

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        adt: torch.Tensor,
        dt: torch.Tensor,
        trap: torch.Tensor,
        q_bias: torch.Tensor,
        k_bias: torch.Tensor,
        angles: torch.Tensor,
        d: torch.Tensor,
        z: torch.Tensor,
        mimo_x: torch.Tensor | None,
        mimo_z: torch.Tensor | None,
        mimo_o: torch.Tensor | None,
        *,
        chunk_size: int,
    ) -> torch.Tensor: ...


@runtime_checkable
class AttentionCore(Protocol):
    """Kind ``attention``: causal attention in MLA's absorbed (MQA) form.

    One shared KV head whose first ``d_v`` dims are the value (the latent ``c_kv``) and whose full width is
    the key (``[c_kv ; k_rope]``)::

        q        [b, s, h, dk]     dk = kv_lora_rank + qk_rope_dim (NAM56R: 64 + 64 = 128)
        kv       [b, s, dk]
        indices  [b, s, topk] int64, key positions per query; -1 = empty slot (sparse only)
        returns  [b, s, h, d_v]    d_v = kv_lora_rank (NAM56R: 64)

    The DSA lightning indexer's own hot loops are a separate kind (``IndexerKernels``).
    """

    def dense(self, q: torch.Tensor, kv: torch.Tensor, *, scale: float, d_v: int) -> torch.Tensor: ...

    def sparse(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float, d_v: int
    ) -> torch.Tensor: ...


@runtime_checkable
class IndexerKernels(Protocol):
    """Kind ``indexer_kernels``: the two hot loops of a DSA layer's lightning indexer (nam56r/blocks/indexer.py,
    whose pure-PyTorch functions are the reference implementations)::

        index_scores(q, k, w)        q [b, s, H, d], k [b, s, d] (model dtype), w [b, s, H] fp32
                                     -> [b, s, s] fp32, I[t, u] = sum_j w[t, j] relu(q[t, j] . k[u]) for
                                     u <= t, -inf above the diagonal; differentiable in q, k and w
        sparse_teacher(q, kv, indices, *, scale)
                                     MLA's q [b, s, h, dk] and kv [b, s, dk] (read detached), indices
                                     [b, s, topk] -> [b, s, topk] fp32: the head-summed per-head softmax over
                                     the live slots, L1-normalised, dead slots 0; no gradient
    """

    def index_scores(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def sparse_teacher(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, scale: float
    ) -> torch.Tensor: ...


@runtime_checkable
class CEHead(Protocol):
    """Kind ``ce``: output projection + cross-entropy, never a full fp32 [tokens, vocab] at once.

    ::

        hidden   [t, d]     final hidden states (any float dtype)
        weight   [v, d]     output head
        target   [t]        int64 token ids
        mask     [t]        float 0/1 loss mask
        returns  scalar fp32: sum over tokens of mask * CE (the caller divides by the mask sum)
    """

    def __call__(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor: ...


@runtime_checkable
class MoEExperts(Protocol):
    """Kind ``moe``: the routed experts of one MoE layer; routing and the shared expert stay in
    the block (nam56r/blocks/moe.py)::

        x          [t, d]      the layer's tokens after its norm
        chosen     [t, k]      int64 expert id per slot
        gates      [t, k]      renormalised top-k router probabilities, x.dtype (carries the router's graph)
        w_gate_up  [E, 2f, d]  per expert: gate rows, then up rows
        w_down     [E, d, f]
        state      what ``layer_state`` returned for this layer (None for a stateless backend)
        returns    [t, d]      sum_j gates[:, j] * down_e(silu(gate_e x) * up_e x) with e = chosen[:, j]

    ``sorted`` is the same computation on rows already sorted by expert (``nam56r.experts``), the layout
    Megatron's token dispatcher hands its experts slot::

        x          [r, d]      one row per (token, slot), sorted by expert
        counts     [E]         int64 rows per expert, on the device (reading it on the host is a sync)
        probs      [r]         each row's gate
        returns    [r, d]      per row: probs * down_e(silu(gate_e x) * up_e x), e the row's expert

    A dispatching backend implements ``sorted`` and gets ``__call__`` from ``nam56r.experts.routed``.

    ``layer_state(cfg)`` is called once per MoE layer when the model is built; a module it returns becomes
    the layer's ``expert_state`` submodule (so it follows ``.to(device)``), e.g. FP8 amax histories. Its
    buffers must be non-persistent: a checkpoint holds the same keys whichever backend wrote it.
    """

    def layer_state(self, cfg: NAM56RConfig) -> torch.nn.Module | None: ...

    def __call__(
        self,
        x: torch.Tensor,
        chosen: torch.Tensor,
        gates: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        state: torch.nn.Module | None,
    ) -> torch.Tensor: ...

    def sorted(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        probs: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        state: torch.nn.Module | None,
    ) -> torch.Tensor: ...


@runtime_checkable
class IndexerStrategy(Protocol):
    """Kind ``indexer``: how a DSA layer picks its top-k keys (the built-in one is ``full``).

    Called once per DSA layer per forward, after MLA's projections and before sparse attention::

        layer    the DSA block: ``layer.indexer`` (its LightningIndexer), ``layer.dsa_rank`` (0-based rank
                 among DSA layers), ``layer.is_mtp``, ``layer.cfg``; ``layer.project(x)`` gives MLA's
                 absorbed q / kv should a strategy need them (e.g. a fused attention + KL kernel)
        x        [b, s, hidden]  block input, already DETACHED (the indexer learns only from its KL loss)
        qr       [b, s, q_lora]  MLA's query latent q_norm(wq_a(x)), already DETACHED
        state    the ForwardState of this micro-batch, or None (no losses, no cache: compute everything)
        returns  (indices, index_scores)
                 indices       [b, s, topk] int64, causal top-k key positions; -1 = empty slot
                               (topk = min(cfg.index_topk, s))
                 index_scores  [b, s, s] fp32, causal-masked (-inf above the diagonal), carrying the
                               graph of the indexer the layer's KL loss should train; or None, and the
                               layer adds no indexer loss (a strategy with its own loss adds it to state)

    Cross-layer data goes in ``state.dsa_cache`` only, never on the strategy object: one state lives for
    one micro-batch. IndexCache, for example, stores a Full layer's indices under its own key together with
    ``state.micro_batch`` and ``state.seq_layout`` and has a Shared layer check both before reusing them
    (a miss raises or recomputes, never reuses stale indices); a Shared layer may return the Full layer's
    ``index_scores`` so its own attention also distils that indexer. With ``state.recompute`` set
    (activation recompute) a strategy must return the same indices as the original pass. MTP layers
    (``layer.is_mtp``) compute their own selection.
    """

    name: str

    def select(
        self, layer: torch.nn.Module, x: torch.Tensor, qr: torch.Tensor, state: ForwardState | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@runtime_checkable
class WarmupStrategy(IndexerStrategy, Protocol):
    """An indexer strategy that, while ``warming_up()``, computes a DSA layer's dense attention itself.

    During the indexer warm-up (DeepSeek-V3.2's dense stage) a DSA layer attends over every past key and its
    indexer learns the attention's distribution. A strategy of this kind produces the attention output and
    the indexer's KL loss together (e.g. one fused kernel) instead of the layer calling the attention core
    and then a separate KL::

        layer    the DSA block (as for ``select``)
        q        [b, s, h, dk]  MLA's absorbed query (carries the main model's graph)
        kv       [b, s, dk]     MLA's KV row (value = first ``layer.kv_lora`` dims; carries the graph)
        x, qr    detached block input and query latent, for the indexer
        state    the ForwardState, or None (no losses)
        returns  [b, s, h, kv_lora] attention output; the strategy adds ``indexer_kl`` (times the layer's
                 ``cfg.indexer_loss_coeff``) to ``state`` itself

    When ``warming_up()`` is False the layer runs ``select`` and the sparse path as for any strategy.
    """

    def warming_up(self) -> bool: ...

    def attend_dense(
        self, layer: torch.nn.Module, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, qr: torch.Tensor,
        state: ForwardState | None,
    ) -> torch.Tensor: ...
