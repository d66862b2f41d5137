"""The NAM56R model: embeddings, the resolved layer stack, the final head and the MTP depths.

Every block gets its backend object from ``Backends``, which the engine fills from the active plugins'
registries by the names in the config (``Backends.from_registries``). Nothing here imports a plugin.

Loss, for one micro-batch::

    lm    = sum_t mask_t * CE(head(h_t), y_t) / sum_t mask_t
    mtp   = mtp_loss_scale / D * sum_{k=1..D} L_k          (DeepSeek-V3 MTP, shared embedding and head)
    total = lm + mtp + sum of auxiliary losses (router balance, indexer KL) already scaled by their coefficients
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from nam56r.backends import BackendContext, build_backend
from nam56r.blocks.dsa import DSA
from nam56r.blocks.mamba3 import Mamba3Mixer
from nam56r.blocks.mla import MLA
from nam56r.blocks.mlp import SwiGLU
from nam56r.blocks.moe import MoE
from nam56r.blocks.ngram_hash import NgramHashEmbedding
from nam56r.blocks.structure import StructureEmbedding
from nam56r.config import NAM56RConfig
from nam56r.kinds import BACKEND_KINDS
from nam56r.pattern import LayerSpec, resolve
from nam56r.recompute import checkpointed
from nam56r.state import ForwardState
from nam_core.kinds import Kind


def backends_class(kinds: Sequence[Kind]) -> type:
    """A frozen dataclass with one field per backend kind of ``kinds`` (``Backends`` is the one of
    ``nam56r.kinds.BACKEND_KINDS``; a test adding a kind makes its own)."""

    def from_registries(cls, registries: Mapping[str, Any], cfg: NAM56RConfig, *,
                        options: Mapping[str, Any] | None = None, device: str = "cpu"):
        """Build the backend each kind's config field names, from active registries (UnknownBackendError
        otherwise). ``options`` (plugin -> parsed options) and ``device`` reach backends that define
        ``build(ctx)`` (``nam56r.backends.BackendContext``)."""
        ctx = BackendContext(model=cfg, options=dict(options or {}), registries=registries, device=device)
        return cls(**{k.name: build_backend(registries[k.name].get(getattr(cfg, k.field)), ctx) for k in kinds})

    def reference(cls):
        """The pure-PyTorch backends (the built-in plugin ``reference``'s), without a plugin host: for tests and
        for counting parameters on the meta device."""
        from nam56r.blocks.indexer import FullIndexer
        from nam56r.reference.attention import ReferenceAttention, ReferenceIndexerKernels
        from nam56r.reference.ce import ReferenceCEHead
        from nam56r.reference.mamba3 import ReferenceSSMScan
        from nam56r.reference.moe import ReferenceExperts

        return Backends(ssm=ReferenceSSMScan(), attention=ReferenceAttention(),
                        indexer_kernels=ReferenceIndexerKernels(), indexer=FullIndexer(), ce=ReferenceCEHead(),
                        moe=ReferenceExperts())

    def as_mapping(self) -> dict[str, Any]:
        """Kind -> backend object (what a ``StepContext`` carries)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    return dataclasses.make_dataclass(
        "Backends", [(k.name, Any) for k in kinds], frozen=True,
        namespace={"from_registries": classmethod(from_registries), "reference": classmethod(reference),
                   "as_mapping": as_mapping, "__module__": __name__,
                   "__doc__": "One object per backend kind (nam56r/kinds.py), shared by every block that needs it."},
    )


Backends = backends_class(BACKEND_KINDS)


class Layer(nn.Module):
    """Pre-norm residual wrapper: ``x + mixer(norm(x))``."""

    def __init__(self, spec: LayerSpec, cfg: NAM56RConfig, backends: Backends, *, is_mtp: bool = False):
        super().__init__()
        self.spec = spec
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        if spec.kind == "mamba":
            self.mixer = Mamba3Mixer(cfg, backends.ssm)
        elif spec.kind == "moe":
            self.mixer = MoE(cfg, backends.moe)
        elif spec.kind == "mla":
            self.mixer = MLA(cfg, backends.attention)
        else:
            self.mixer = DSA(cfg, backends.attention, backends.indexer, dsa_rank=spec.dsa_rank, is_mtp=is_mtp,
                             indexer_kernels=backends.indexer_kernels)

    recompute: str | None = None
    """``None``, or the recompute kind that covers this layer (``nam56r.recompute.apply``): ``layer`` recomputes
    norm and mixer in backward, any other kind the mixer alone."""

    def forward(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        if self.recompute == "layer":
            return checkpointed(self._body, state, x)
        if self.recompute is not None:
            return x + checkpointed(self.mixer, state, self.norm(x))
        return self._body(x, state)

    def _body(self, x: torch.Tensor, state: ForwardState) -> torch.Tensor:
        return x + self.mixer(self.norm(x), state)


class MTPDepth(nn.Module):
    """One multi-token-prediction depth: combine h with the next token's embedding, one MLA layer, one MLP."""

    def __init__(self, cfg: NAM56RConfig, backends: Backends):
        super().__init__()
        self.norm_h = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.norm_e = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)
        self.attn = Layer(LayerSpec(index=-1, symbol="A", attention_rank=-1), cfg, backends, is_mtp=True)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden, cfg.mtp_ffn_hidden, init_std=cfg.init_std)
        self.final_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)

    def forward(self, h: torch.Tensor, next_emb: torch.Tensor, state: ForwardState) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.norm_h(h), self.norm_e(next_emb)], dim=-1))  # [b, s, d]
        x = self.attn(x, state)
        return x + self.mlp(self.mlp_norm(x))


def shift_left(t: torch.Tensor, k: int, fill: int | float = 0) -> torch.Tensor:
    """``t[:, i + k]`` at position i along dim 1, ``fill`` past the end. [b, s] -> [b, s]."""
    if k == 0:
        return t
    pad = torch.full_like(t[:, :k], fill)
    return torch.cat([t[:, k:], pad], dim=1)


class NAM56R(nn.Module):
    def __init__(self, cfg: NAM56RConfig, backends: Backends):
        super().__init__()
        self.cfg = cfg
        self.backends = backends
        self.plan = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.ngram = NgramHashEmbedding(cfg) if self.plan.ngram_head else None
        self.structure = StructureEmbedding(cfg) if cfg.structure_vocab > 0 else None
        self.layers = nn.ModuleList(Layer(spec, cfg, backends) for spec in self.plan.layers)
        self.final_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden))
        self.mtp = nn.ModuleList(MTPDepth(cfg, backends) for _ in range(cfg.mtp_depths))
        self._init_embeddings()

    def _init_embeddings(self) -> None:
        nn.init.normal_(self.embed.weight, std=self.cfg.init_std)
        if self.head is not None:
            nn.init.normal_(self.head, std=self.cfg.init_std)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head

    def _ce(self, h: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Masked mean CE of hidden ``h [b, s, d]`` against ``target [b, s]`` through the CE backend."""
        total = self.backends.ce(h.flatten(0, 1), self.head_weight, target.flatten(), mask.flatten())
        return total / mask.sum().clamp(min=1.0)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        structure: torch.Tensor | None = None,
        state: ForwardState | None = None,
    ) -> dict[str, torch.Tensor]:
        """tokens, labels, loss_mask, segment_ids, structure: [b, s]. Returns losses (``loss`` to backward)."""
        b, s = tokens.shape
        state = state if state is not None else ForwardState(seq_layout=(b, s))
        loss_mask = loss_mask.to(torch.float32)
        h = self.embed(tokens)  # [b, s, d]
        if self.ngram is not None:
            h = h + self.ngram(tokens, segment_ids)
        if self.structure is not None and structure is not None:
            h = h + self.structure(structure)
        for layer in self.layers:
            h = layer(h, state)
        lm = self._ce(self.final_norm(h), labels, loss_mask)

        mtp_losses = []
        for k, depth in enumerate(self.mtp, start=1):
            # Depth k sees token t+k (label y_{t+k-1}) and predicts y_{t+k}; the last k positions have no
            # target, and a target in another document of the packed row is masked out.
            mask = shift_left(loss_mask, k)
            if segment_ids is not None:
                mask = mask * (shift_left(segment_ids, k, fill=-1) == segment_ids)
            h = depth(h, self.embed(shift_left(labels, k - 1)), state)
            mtp_losses.append(self._ce(depth.final_norm(h), shift_left(labels, k), mask))

        out = {"lm_loss": lm}
        total = lm
        if mtp_losses:
            out["mtp_loss"] = torch.stack(mtp_losses).sum() * (self.cfg.mtp_loss_scale / len(mtp_losses))
            total = total + out["mtp_loss"]
        for name, values in state.aux_losses.items():
            out[name] = torch.stack(values).sum()
            total = total + out[name]
        out["loss"] = total
        return out


def build_model(cfg: NAM56RConfig, backends: Backends | None = None, *, device: str | torch.device = "cpu") -> NAM56R:
    """Build NAM56R on ``device`` (``"meta"`` allocates nothing: for counting and dry runs)."""
    with torch.device(device):
        return NAM56R(cfg, backends if backends is not None else Backends.reference())


def count_parameters(cfg: NAM56RConfig) -> dict:
    """Parameter counts from a meta-device build (no weights allocated).

    ``active_per_token`` is the total minus the routed experts a token does not visit:
    (num_experts - moe_topk) / num_experts of every MoE layer's routed-expert parameters. Embedding tables
    count in full, as is conventional for MoE "activated parameters".
    """
    model = build_model(cfg, device="meta")
    by_kind: dict[str, int] = {}
    for layer in model.layers:
        by_kind[layer.spec.kind] = by_kind.get(layer.spec.kind, 0) + sum(p.numel() for p in layer.parameters())
    by_kind["embedding"] = model.embed.weight.numel()
    by_kind["ngram_hash"] = sum(p.numel() for p in model.ngram.parameters()) if model.ngram is not None else 0
    by_kind["structure"] = sum(p.numel() for p in model.structure.parameters()) if model.structure is not None else 0
    by_kind["head"] = model.head.numel() if model.head is not None else 0
    by_kind["mtp"] = sum(p.numel() for p in model.mtp.parameters())
    by_kind["final_norm"] = model.final_norm.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(by_kind.values()), "every parameter belongs to exactly one group"
    routed = sum(
        layer.mixer.w_gate_up.numel() + layer.mixer.w_down.numel()
        for layer in model.layers if layer.spec.kind == "moe"
    )
    inactive = routed * (cfg.num_experts - cfg.moe_topk) // cfg.num_experts
    return {"total": total, "active_per_token": total - inactive, "by_kind": by_kind}
