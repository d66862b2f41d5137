"""The thin step of the lowering: NAM56R as Megatron-Core >= 0.19 modules, for the megatron engine.

``nam56r.megatron.lower`` says, as data, what goes where; this module builds it. Megatron's ``HybridModel``
gets nam56r's Mamba-3, DSA and MLA blocks in its ``M``, ``D`` and ``+`` slots behind small adapters with each
slot's call signature, Megatron's ``MoELayer`` for ``E`` (expert parallelism through its dispatcher), and,
around the stack, nam's n-gram and structure embeddings, final norm and CE head (the active ``ce_heads``
backend, never Megatron's logits + cross-entropy). ``NamMegatronModel`` hands all of it to
``nam_core.engine.megatron`` (its ``MegatronModel`` protocol); the engine knows nothing of NAM56R.

Megatron is imported inside functions only, so this module imports on a CPU machine with any megatron-core
(CI has 0.16.1 on Python 3.11); the weight map and the checks run there. Section numbers (§) refer to
``shared/reference/megatron-core.md``.

Where the built model departs from stock Megatron, on purpose, so both engines train the same model:

* the stack has no final norm (``post_layer_norm=False``: the stock one is Transformer Engine's, §1.4), and
  the MTP depths have no norm of their own on the way out (``layer_norm=IdentityOp``); nam's norms are applied
  where nam applies them: before each CE head, while the next MTP depth gets the un-normed hidden state
  (DeepSeek-V3's chain, as ``nam56r.model.MTPDepth``);
* the losses are nam's: mean CE per micro-batch through the CE backend, MTP targets masked at document
  boundaries, ``mtp_loss_scale / D`` per depth; aux losses that nam blocks add to their ``ForwardState``
  (the DSA indexer KL) reach backward through ``DSAIndexerLossAutoScaler``, whose scale the 0.19 schedules
  set to ``loss_scale / num_microbatches`` for ``experimental_attention_variant='dsa'``;
* weights start from nam's own initialisation (``nam56r.model.build_model`` after ``torch.manual_seed``, as
  ``nam train`` does), copied in by ``nam_state_to_megatron``; Megatron initialises nothing itself.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from nam56r.megatron import Lowering
from nam_core.errors import ConfigError, NamError

KIND = {"M": "mamba", "E": "moe", "A": "mla", "D": "dsa"}
"""nam layer symbol -> the kind ``nam_state_to_megatron`` maps."""

COVERED_GAPS = {
    "DSA indexer loss scale": "AttentionSlot attaches ForwardState aux losses through DSAIndexerLossAutoScaler",
    "final norm": "NamHybridModel.final_norm (torch RMSNorm); the stack is built with post_layer_norm=False",
    "CE head": "NamHybridModel.forward: LM and MTP losses through the active ce_heads backend",
    "n-gram hash and structure embeddings": "NamHybridModel.ngram / .structure, added on the first stage",
    "slot contract": "MambaSlot and AttentionSlot",
}
"""Open gaps of the lowering (``Lowering.open_gaps``, by ``Gap.what``) that this module closes. Any other
open gap refuses the run (e.g. tensor parallelism in nam slots)."""


def check_lowering(lowering: Lowering, *, registered_schedules: Mapping[str, Any]) -> None:
    """Refuse a lowering this module cannot build: an open gap it does not close, or CUDA graphs."""
    uncovered = [g for g in lowering.open_gaps if g.what not in COVERED_GAPS]
    if lowering.chunks > 1 and lowering.schedule not in registered_schedules:
        raise ConfigError(f"the model was lowered for {lowering.schedule}'s V ({lowering.chunks} chunks per pipeline "
                          f"rank) and no registered schedule of that name drives it (registered: "
                          f"{', '.join(sorted(registered_schedules)) or 'none'})",
                          hint=f"--plugins {lowering.schedule}, or --set train.schedule=1f1b")
    if uncovered:
        raise ConfigError("the megatron engine cannot close these gaps of the lowering: "
                          + "; ".join(f"{g.what} ({g.nam})" for g in uncovered),
                          hint="`nam recipe show NAME --megatron-args` lists the gaps; e.g. --tp 1")
    if lowering.cuda_graphs:
        raise ConfigError("the lowering asks for CUDA graphs, which the megatron engine does not capture",
                          hint="leave CUDA graphs off")


# --- weights: nam's state dict in Megatron's names (CPU-testable) ---------------------------------------


def _mtp_positions(mtp_pattern: str) -> tuple[int, int]:
    """Stack positions of the MLA and the MLP layer inside one MTP depth (nam's MTPDepth: attention, MLP)."""
    if sorted(mtp_pattern) != sorted("+-"):
        raise ConfigError(f"MTP depth pattern {mtp_pattern!r}: the weight map knows nam's MTPDepth ('+-') only",
                          hint="the lowering's MTP_DEPTH and nam56r.model.MTPDepth must change together")
    return mtp_pattern.index("+"), mtp_pattern.index("-")


def nam_state_to_megatron(
    state: Mapping[str, torch.Tensor],
    kinds: tuple[str, ...],
    *,
    mtp_pattern: str = "+-",
    ep_rank: int = 0,
    ep_size: int = 1,
    first: int = 0,
    stop: int | None = None,
    pre_process: bool = True,
    post_process: bool = True,
    mtp_process: bool = True,
) -> dict[str, torch.Tensor]:
    """nam56r.model.NAM56R's ``state_dict`` renamed (and sliced) for one rank's ``NamHybridModel``.

    ``kinds``: per stack layer, ``mamba``/``moe``/``mla``/``dsa``; this rank holds layers ``[first, stop)``
    and, of every MoE layer, experts ``[ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size)``. Embedding,
    n-gram and structure tables go to the first stage; final norm, head and MTP to the last (the last stage
    keeps its own copy of the token embedding for MTP, as HybridModel does). Unknown keys raise.
    """
    stop = len(kinds) if stop is None else stop
    attn_pos, mlp_pos = _mtp_positions(mtp_pattern)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        head, _, rest = key.partition(".")
        if head == "embed":
            if pre_process or mtp_process:
                out[f"embedding.word_embeddings.{rest}"] = value
        elif head in ("ngram", "structure"):
            if pre_process:
                out[key] = value
        elif head in ("final_norm", "head"):
            if post_process:
                out["output_layer.weight" if head == "head" else key] = value
        elif head == "layers":
            index, _, name = rest.partition(".")
            i = int(index)
            if first <= i < stop:
                out.update(_layer_weights(kinds[i], f"decoder.layers.{i - first}.", name, value, ep_rank, ep_size))
        elif head == "mtp":
            if mtp_process:
                depth, _, name = rest.partition(".")
                out.update(_mtp_weights(int(depth), name, value, attn_pos, mlp_pos))
        else:
            raise NamError(f"nam parameter {key!r} has no place in the Megatron model",
                           hint="nam_state_to_megatron must learn it (nam_core/engine/megatron.py)")
    return out


def _layer_weights(kind: str, prefix: str, name: str, value: torch.Tensor, ep_rank: int, ep_size: int) -> dict:
    norm = {"mamba": "norm", "moe": "pre_mlp_layernorm", "mla": "input_layernorm", "dsa": "input_layernorm"}
    if name.startswith("norm."):
        return {prefix + norm[kind] + name[len("norm"):]: value}
    sub = name[len("mixer."):]
    if kind == "mamba":
        return {f"{prefix}mixer.block.{sub}": value}
    if kind in ("mla", "dsa"):
        return {f"{prefix}self_attention.block.{sub}": value}
    if sub in ("w_gate_up", "w_down"):  # [E, 2f, d] / [E, d, f] -> this rank's SequentialMLP experts
        local = value.shape[0] // ep_size
        fc = "linear_fc1" if sub == "w_gate_up" else "linear_fc2"
        return {f"{prefix}mlp.experts.local_experts.{j}.{fc}.weight": value[ep_rank * local + j]
                for j in range(local)}
    shared = {"shared.w_gate_up.weight": "shared_experts.linear_fc1.weight",
              "shared.w_down.weight": "shared_experts.linear_fc2.weight", "router.weight": "router.weight"}
    if sub not in shared:
        raise NamError(f"MoE parameter {name!r} has no place in Megatron's MoELayer",
                       hint="nam_state_to_megatron must learn it (nam_core/engine/megatron.py)")
    return {f"{prefix}mlp.{shared[sub]}": value}


def _mtp_weights(depth: int, name: str, value: torch.Tensor, attn_pos: int, mlp_pos: int) -> dict:
    prefix = f"mtp.layers.{depth}."
    inner = f"{prefix}mtp_model_layer.layers."
    if name == "eh_proj.weight":
        # nam projects cat(norm_h(h), norm_e(e)); Megatron cat(enorm(e), hnorm(h)): swap the column halves.
        h = value.shape[1] // 2
        return {prefix + name: torch.cat([value[:, h:], value[:, :h]], dim=1)}
    renamed = {"norm_h.weight": prefix + "hnorm.weight", "norm_e.weight": prefix + "enorm.weight",
               "attn.norm.weight": f"{inner}{attn_pos}.input_layernorm.weight",
               "mlp_norm.weight": f"{inner}{mlp_pos}.pre_mlp_layernorm.weight",
               "mlp.w_gate_up.weight": f"{inner}{mlp_pos}.mlp.linear_fc1.weight",
               "mlp.w_down.weight": f"{inner}{mlp_pos}.mlp.linear_fc2.weight",
               "final_norm.weight": f"mtp_norms.{depth}.weight"}
    if name in renamed:
        return {renamed[name]: value}
    if name.startswith("attn.mixer."):
        return {f"{inner}{attn_pos}.self_attention.block.{name[len('attn.mixer.'):]}": value}
    raise NamError(f"MTP parameter {name!r} has no place in Megatron's MTP layer",
                   hint="nam_state_to_megatron must learn it (nam_core/engine/megatron.py)")


# --- the model: adapters that put nam blocks into Megatron's slots ---------------------------------------


class Slots:
    """What every nam adapter of one model chunk shares: the nam config and backends, the DSA rank of each
    Megatron ``layer_number``, the device nam blocks are built on, the ``ForwardState`` of the forward in
    flight, and this step's aux-loss sums and log lines."""

    def __init__(self, cfg, backends, dsa_ranks: Mapping[int, int], device: torch.device | str = "cpu"):
        self.cfg, self.backends, self.dsa_ranks, self.device = cfg, backends, dict(dsa_ranks), torch.device(device)
        self.state = None
        self.aux: dict[str, torch.Tensor] = {}
        self.notes: list[str] = []

    def start(self, state) -> None:
        """A new forward begins: keep the finished one's log lines (blocks' ``ForwardState.log``)."""
        if self.state is not None:
            self.notes.extend(self.state.log)
        self.state = state

    def log(self, name: str, value: torch.Tensor) -> None:
        self.aux[name] = self.aux.get(name, 0) + value.detach().float()

    def end_step(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        """This step's aux-loss sums and log lines; both start empty again."""
        self.start(None)
        aux, notes, self.aux, self.notes = self.aux, self.notes, {}, []
        return aux, notes


def _refuse_unsupported(inference_context, packed_seq_params) -> None:
    if inference_context is not None or packed_seq_params is not None:
        raise NamError("nam slots in Megatron train only: no inference context, no packed (THD) sequences",
                       hint="packed rows reach nam blocks as segment_ids through the engine's forward step")


class MambaSlot(nn.Module):
    """``mamba_layer.submodules.mixer``: nam's Mamba3Mixer behind MambaLayer's mixer contract (§2).

    Built as ``(config, d_model=, layer_number=, pg_collection=, pp_layer_offset=, name=)``; called with
    ``[s, b, h]``; returns ``(out [s, b, h], None)`` for the layer's bias-dropout-add.
    """

    def __init__(self, config=None, d_model=None, layer_number=None, pg_collection=None, pp_layer_offset=0,
                 name=None, *, nam: Slots):
        super().__init__()
        from nam56r.blocks.mamba3 import Mamba3Mixer

        self.nam = nam
        self.layer_number = layer_number
        with nam.device:
            self.block = Mamba3Mixer(nam.cfg, nam.backends.ssm)

    def forward(self, hidden_states, inference_context=None, packed_seq_params=None):
        _refuse_unsupported(inference_context, packed_seq_params)
        out = self.block(hidden_states.transpose(0, 1), self.nam.state)  # [b, s, h]
        return out.transpose(0, 1), None


class AttentionSlot(nn.Module):
    """``dsa_layer``/``mla_layer`` ``.submodules.self_attention``: nam's DSA or MLA behind TransformerLayer's
    attention contract (§1.4). Aux losses the block adds to the ForwardState (the indexer KL) are attached to
    the output through ``DSAIndexerLossAutoScaler``, so they reach backward from any pipeline stage."""

    def __init__(self, config=None, layer_number=None, pg_collection=None, pp_layer_offset=None, cp_comm_type=None,
                 name=None, *, nam: Slots, sparse: bool):
        super().__init__()
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        from nam56r.blocks.dsa import DSA
        from nam56r.blocks.mla import MLA

        self.nam, self.layer_number, self.attach = nam, layer_number, DSAIndexerLossAutoScaler.apply
        backends = nam.backends
        if sparse and layer_number not in nam.dsa_ranks:
            raise NamError(f"Megatron built a DSA slot at layer_number {layer_number}, where the lowering has "
                           f"no D layer (D layers: {sorted(nam.dsa_ranks)})",
                           hint="DSA inside an MTP depth is not lowered; keep the MTP depth '+-'")
        with nam.device:
            if sparse:
                self.block = DSA(nam.cfg, backends.attention, backends.indexer, dsa_rank=nam.dsa_ranks[layer_number])
            else:
                self.block = MLA(nam.cfg, backends.attention)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                **unused):  # rotary_pos_emb/cos/sin, attention_bias, sequence_len_offset: None here (MLA ropes itself)
        _refuse_unsupported(inference_context, packed_seq_params)
        state = self.nam.state
        before = {name: len(values) for name, values in state.aux_losses.items()}
        out = self.block(hidden_states.transpose(0, 1), state).transpose(0, 1)  # [s, b, h]
        for name, values in state.aux_losses.items():
            added = values[before.get(name, 0):]
            if added:
                loss = torch.stack(added).sum()
                out = self.attach(out, loss)
                self.nam.log(name, loss)
        return out, None


def transformer_config(lowering) -> Any:
    """``MLATransformerConfig`` from the lowering's ``config_args``, with what a run without Transformer
    Engine and with nam's initialisation needs on top (each override says why)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    args = dict(lowering.config_args)
    args["activation_func"] = {"silu": F.silu}[args["activation_func"]]
    args["params_dtype"] = getattr(torch, args["params_dtype"])
    args.update(
        pipeline_dtype=args["params_dtype"],  # the dtype of activations sent between stages
        hidden_dropout=0.0, attention_dropout=0.0,  # nam56r has no dropout (Megatron defaults to 0.1)
        perform_initialization=False,  # weights come from nam's initialisation (nam_state_to_megatron)
    )
    if lowering.chunks > 1:
        # Each chunk is built with its vp_stage (0 down the V, 1 back up); LanguageModule's embedding setup
        # asserts that an MTP stage without embeddings is not the first virtual stage of pipeline rank 0,
        # which only holds when it knows the virtual size. Megatron's interleaved schedule never runs here
        # (the schedule is the registered dualpipev), and parallel_state gets no virtual size.
        args["virtual_pipeline_model_parallel_size"] = lowering.chunks
    return MLATransformerConfig(**args)


def hybrid_stack_spec(lowering, slots: Slots):
    """The ``HybridStack`` spec: Megatron classes named by the lowering, nam blocks through the adapters."""
    from functools import partial

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    nam_blocks = {"mamba_layer.submodules.mixer": "nam56r.blocks.mamba3.Mamba3Mixer",
                  "dsa_layer.submodules.self_attention": "nam56r.blocks.dsa.DSA",
                  "mla_layer.submodules.self_attention": "nam56r.blocks.mla.MLA",
                  "embedding": "nam56r.blocks.ngram_hash.NgramHashEmbedding"}
    megatron = {s.path: import_module(tuple(s.module.rsplit(".", 1))) for s in lowering.slots if s.provider == "megatron"}
    nam = {s.path: s.module for s in lowering.slots if s.provider == "nam"}
    known = {"mamba_layer", "mamba_layer.submodules.norm", "moe_layer", "moe_layer.submodules.mlp", "dsa_layer",
             "mla_layer", "mlp_layer", "mtp_block_spec", "final_norm", "output_layer"}
    if nam != nam_blocks or set(megatron) != known:
        raise ConfigError("the lowering's slots differ from the ones this engine builds: "
                          f"nam {sorted(nam.items())}, megatron {sorted(megatron)}",
                          hint="nam56r/megatron.py and nam_core/engine/megatron.py must change together")
    norm = megatron["mamba_layer.submodules.norm"]  # WrappedTorchNorm: torch RMSNorm, no Transformer Engine
    bda = get_bias_dropout_add
    moe = get_moe_module_spec(use_te=False, num_experts=lowering.config_args["num_moe_experts"],
                              moe_grouped_gemm=False)
    if moe.func is not megatron["moe_layer.submodules.mlp"]:
        raise ConfigError(f"Megatron's local MoE spec builds {moe.func.__name__}, the lowering names MoELayer",
                          hint="check megatron-core's get_moe_module_spec")

    def attention(sparse: bool):
        return TransformerLayerSubmodules(
            input_layernorm=norm, self_attn_bda=bda,
            self_attention=ModuleSpec(module=AttentionSlot, params={"nam": slots, "sparse": sparse}))

    mtp_layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None,
        layer_norm=IdentityOp))  # nam's MTP norms live in NamHybridModel.mtp_norms (module docstring)
    return ModuleSpec(
        module=HybridStack,
        params={"post_layer_norm": False},  # the final norm is NamHybridModel.final_norm
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(module=megatron["mamba_layer"], submodules=MambaLayerSubmodules(
                norm=norm, mixer=ModuleSpec(module=MambaSlot, params={"nam": slots}), mamba_bda=bda)),
            dsa_layer=ModuleSpec(module=megatron["dsa_layer"], submodules=attention(True)),
            mla_layer=ModuleSpec(module=megatron["mla_layer"], submodules=attention(False)),
            moe_layer=ModuleSpec(module=megatron["moe_layer"], submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=norm, mlp=moe, mlp_bda=bda)),
            mlp_layer=ModuleSpec(module=megatron["mlp_layer"], submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=norm, mlp_bda=bda, mlp=partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)))),
            mtp_block_spec=ModuleSpec(module=megatron["mtp_block_spec"],
                                      submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer])),
        ),
    )


@contextlib.contextmanager
def _v_stage(layer_types: list[str], offset: int, *, mtp: bool):
    """While HybridModel builds one V chunk: Megatron's segment choice gives it ``layer_types`` at global
    ``offset``, and MTP exactly when ``mtp``.

    Megatron picks a chunk's `|` segment as ``vp_stage * pp + pp_rank`` (interleaved) and puts MTP on the last
    pipeline rank; DualPipeV's V needs stage ``2 pp - 1 - rank`` on vp_stage 1 and MTP on rank 0 (§1.3, §7).
    HybridModel.__init__ imports ``select_pipeline_segment`` from its module at call time and
    ``mtp_on_this_rank`` at module import, so both names are swapped for the duration of the build and put
    back after, whatever happens.
    """
    from megatron.core.models.hybrid import hybrid_layer_allocation as allocation
    from megatron.core.models.hybrid import hybrid_model

    saved = allocation.select_pipeline_segment, hybrid_model.mtp_on_this_rank
    allocation.select_pipeline_segment = lambda *args, **kwargs: (list(layer_types), offset)
    hybrid_model.mtp_on_this_rank = lambda *args, **kwargs: mtp
    try:
        yield
    finally:
        allocation.select_pipeline_segment, hybrid_model.mtp_on_this_rank = saved


def _masked_ce(ce, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mask: torch.Tensor):
    """Mean CE of ``hidden [s, b, d]`` against ``target``/``mask [b, s]`` through the CE backend."""
    total = ce(hidden.flatten(0, 1), weight, target.t().reshape(-1), mask.t().reshape(-1))
    return total / mask.sum().clamp(min=1.0)


@functools.cache
def nam_hybrid_model_class():
    """``NamHybridModel``: Megatron's HybridModel with nam's embeddings, norms and losses (module docstring)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from nam56r.blocks.ngram_hash import NgramHashEmbedding
    from nam56r.blocks.structure import StructureEmbedding
    from nam56r.model import shift_left
    from nam56r.pattern import resolve
    from nam56r.state import ForwardState

    class NamHybridModel(HybridModel):
        def __init__(self, config, hybrid_stack_spec, *, slots: Slots, norm, **model_args):
            super().__init__(config, hybrid_stack_spec, **model_args)
            cfg = slots.cfg
            self.slots = slots
            self.ngram = self.structure = self.final_norm = self.mtp_norms = None
            with slots.device:
                if self.pre_process and resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks).ngram_head:
                    self.ngram = NgramHashEmbedding(cfg)
                if self.pre_process and cfg.structure_vocab > 0:
                    self.structure = StructureEmbedding(cfg)
                if self.post_process:
                    self.final_norm = norm(config=config, hidden_size=config.hidden_size,
                                           eps=config.layernorm_epsilon)
                if self.mtp_process:
                    self.mtp_norms = nn.ModuleList(
                        norm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
                        for _ in range(self.mtp_num_depths))

        def forward(self, input_ids, position_ids=None, attention_mask=None, *, labels=None, loss_mask=None,
                    segment_ids=None, structure=None, micro_batch: int = 0):
            """tokens, labels, loss_mask, segment_ids, structure: [b, s] on every stage. Returns the hidden
            state [s, b, h] on all but the last stage, there a dict of losses (``lm_loss``, ``mtp_loss``)."""
            b, s = input_ids.shape
            self.slots.start(ForwardState(micro_batch=micro_batch, seq_layout=(b, s)))
            decoder_input = None
            if self.pre_process:
                decoder_input = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
                if self.ngram is not None:
                    decoder_input = decoder_input + self.ngram(input_ids, segment_ids).transpose(0, 1)
                if self.structure is not None and structure is not None:
                    decoder_input = decoder_input + self.structure(structure).transpose(0, 1)
            hidden = self.decoder(hidden_states=decoder_input, attention_mask=None)  # [s, b, h], no final norm
            if not self.post_process:
                return hidden
            depths = [hidden]
            if self.mtp_process:  # [(1 + D) s, b, h]: main, then each depth's un-normed output
                chained = self.mtp(input_ids=input_ids, position_ids=None, hidden_states=hidden,
                                   attention_mask=None, embedding=self.embedding)
                depths = torch.chunk(chained, 1 + self.mtp_num_depths, dim=0)
            return self._losses(depths, labels, loss_mask.float(), segment_ids)

        def _losses(self, depths, labels, mask, segment_ids) -> dict:
            ce, weight = self.slots.backends.ce, (self.shared_embedding_or_output_weight()
                                                  if self.share_embeddings_and_output_weights
                                                  else self.output_layer.weight)
            out = {"lm_loss": _masked_ce(ce, self.final_norm(depths[0]), weight, labels, mask)}
            mtp = []
            for k in range(1, len(depths)):  # as nam56r.model.NAM56R.forward
                m = shift_left(mask, k)
                if segment_ids is not None:
                    m = m * (shift_left(segment_ids, k, fill=-1) == segment_ids)
                mtp.append(_masked_ce(ce, self.mtp_norms[k - 1](depths[k]), weight, shift_left(labels, k), m))
            if mtp:
                out["mtp_loss"] = torch.stack(mtp).sum() * (self.slots.cfg.mtp_loss_scale / len(mtp))
            return out

    return NamHybridModel


def for_this_rank(model, nam_tensors: Mapping[str, torch.Tensor], lowering, pg_collection) -> dict:
    """``nam_tensors`` (keyed by nam56r parameter names: weights, or their gradients) renamed and sliced for
    one rank's (unwrapped) NamHybridModel: its pipeline stage, its experts."""
    numbers = [layer.layer_number for layer in model.decoder.layers]  # 1-based, global
    kinds = tuple(KIND[layer["nam"]] for layer in lowering.layers)
    return nam_state_to_megatron(
        nam_tensors, kinds, mtp_pattern=lowering.mtp_pattern or "+-", ep_rank=pg_collection.ep.rank(),
        ep_size=pg_collection.ep.size(), first=numbers[0] - 1 if numbers else 0,
        stop=numbers[-1] if numbers else 0, pre_process=model.pre_process, post_process=model.post_process,
        mtp_process=model.mtp_process)


def load_nam_weights(model, nam_state: Mapping[str, torch.Tensor], lowering, pg_collection) -> None:
    """Copy a nam56r state dict into one rank's (unwrapped) NamHybridModel; every parameter and persistent
    buffer must be written exactly once, or nothing trains."""
    mapped = for_this_rank(model, nam_state, lowering, pg_collection)
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]  # Megatron linears' (empty) extra state
    if missing or unexpected:
        raise NamError(f"the nam weights do not fill the Megatron model: missing {missing[:8]}, unexpected "
                       f"{unexpected[:8]}", hint="nam_state_to_megatron and the spec disagree; fix the map")


@dataclass
class NamMegatronModel:
    """NAM56R for the megatron engine (``nam_core.engine.megatron.MegatronModel``): one lowering, the active
    backends, and where the weights start (``init_from``: a nam ``model.pt``; default nam's initialisation
    at ``seed``, as ``nam train`` builds the local model)."""

    cfg: Any
    """nam56r.config.NAM56RConfig."""
    backends: Any
    """nam56r.model.Backends built from the active plugins (``Backends.from_registries``)."""
    lowering: Lowering
    seed: int
    init_from: Path | None = None

    @property
    def parallel(self) -> dict[str, int]:
        args = self.lowering.config_args
        return {"tp": args["tensor_model_parallel_size"], "pp": args["pipeline_model_parallel_size"],
                "ep": args["expert_model_parallel_size"]}

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (2 for DualPipeV's V): ``build`` is called once per chunk."""
        return self.lowering.chunks

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    @property
    def moe_aux_loss_coeff(self) -> float:
        return self.cfg.moe_aux_loss_coeff

    def check(self, *, registered_schedules: Mapping[str, Any]) -> None:
        check_lowering(self.lowering, registered_schedules=registered_schedules)

    def transformer_config(self):
        return transformer_config(self.lowering)

    def build(self, config, pg_collection, device: torch.device, chunk: int = 0) -> nn.Module:
        """This rank's model chunk ``chunk`` (its pipeline stage, ``nam56r.megatron.stage_of``) on ``device``,
        every weight filled from nam's state."""
        from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

        from nam56r.megatron import stage_of
        from nam56r.model import build_model as build_nam_model

        lowering = self.lowering
        dsa_ranks = {layer["layer_number"]: layer["dsa_rank"] for layer in lowering.layers if layer["megatron"] == "D"}
        slots = Slots(self.cfg, self.backends, dsa_ranks, device=device)  # nam blocks are built on the GPU directly
        spec = hybrid_stack_spec(lowering, slots)
        norm = spec.submodules.mamba_layer.submodules.norm
        build = functools.partial(nam_hybrid_model_class(), config, spec, slots=slots, norm=norm,
                                  **lowering.model_args, pg_collection=pg_collection)
        if lowering.chunks == 1:
            model = build(pre_process=is_pp_first_stage(pg_collection.pp),
                          post_process=is_pp_last_stage(pg_collection.pp))
        else:  # a V chunk: its stage's layers, embeddings on stage 0, output layer and MTP on the last
            pp = pg_collection.pp.size()
            stage = stage_of(pg_collection.pp.rank(), chunk, pp=pp, chunks=lowering.chunks)
            mine = [layer for layer in lowering.layers if layer["pp_stage"] == stage]
            last = stage == pp * lowering.chunks - 1
            mtp = last and lowering.mtp_depths > 0
            with _v_stage([layer["megatron"] for layer in mine], mine[0]["index"], mtp=mtp):
                model = build(pre_process=stage == 0, post_process=last, vp_stage=chunk)
        model = model.to(device)  # Megatron's parallel layers are there already; its torch norms are not
        if self.init_from is not None:
            state = torch.load(self.init_from, map_location=device, weights_only=True)
        else:  # what `nam train` does before building the local model: same seed, same init, same weights
            torch.manual_seed(self.seed)
            state = build_nam_model(self.cfg, self.backends, device=device).state_dict()
        load_nam_weights(model, state, lowering, pg_collection)
        return model

    def forward_step(self, data_iterator, model):
        """Megatron's ``forward_step_func``: the batches are ``(index, {tokens, labels, loss_mask, ...})``."""
        index, batch = next(data_iterator)
        out = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                    segment_ids=batch.get("segment_ids"), structure=batch.get("structure"), micro_batch=index)

        def loss_func(losses: dict):
            total = losses["lm_loss"] + losses.get("mtp_loss", 0.0)
            return total, {k: v.detach() for k, v in losses.items()}

        return out, loss_func

    def end_step(self, model) -> tuple[dict[str, torch.Tensor], list[str]]:
        """This step's aux-loss sums (by name) and block log lines, from the unwrapped model."""
        return model.slots.end_step()
