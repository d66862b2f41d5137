"""NAM56R as a Megatron-Core model for the megatron engine: ``NamHybridModel`` (Megatron's HybridModel with
nam's embeddings, norms and losses) and ``NamMegatronModel`` (the engine's ``MegatronModel``: one lowering,
the active backends, the weights).

Where the built model departs from stock Megatron, on purpose, so both engines train the same model (the
lowering's gaps say which Megatron lack each covers):

* the stack has no final norm (``post_layer_norm=False``: the stock one is Transformer Engine's, §1.4), and
  the MTP depths have no norm of their own on the way out (``layer_norm=IdentityOp``); nam's norms are applied
  where nam applies them: before each CE head, while the next MTP depth gets the un-normed hidden state
  (DeepSeek-V3's chain, as ``nam56r.model.MTPDepth``);
* the losses are nam's: mean CE per micro-batch through the CE backend, MTP targets masked at document
  boundaries, ``mtp_loss_scale / D`` per depth; aux losses that nam blocks add to their ``ForwardState``
  (the DSA indexer KL) reach backward through ``DSAIndexerLossAutoScaler`` (``slots.AttentionSlot``);
* weights start from nam's own initialisation (``nam56r.model.build_model`` after ``torch.manual_seed``, as
  ``nam train`` does), copied in by ``weights.load_nam_weights``; Megatron initialises nothing itself.

Megatron is imported inside functions only (CI has megatron-core 0.16.1). Section numbers (§) refer to
``shared/reference/megatron-core.md``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from nam56r.megatron import patches
from nam56r.megatron.lowering import Lowering, check_lowering
from nam56r.megatron.slots import Slots
from nam56r.megatron.spec import hybrid_stack_spec, slot_class, transformer_config
from nam56r.megatron.weights import for_this_rank, load_nam_weights
from nam_core.engine.megatron.schedule import resolve_schedule
from nam_core.errors import ConfigError
from nam_core.patches import applied


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
        """Model chunks per pipeline rank (the schedule's): ``build`` is called once per chunk."""
        return self.lowering.chunks

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    @property
    def moe_aux_loss_coeff(self) -> float:
        return self.cfg.moe_aux_loss_coeff

    def check(self, *, registered_schedules: Mapping[str, Any]) -> None:
        """Refuse what the build cannot run (``check_lowering``), and a lowering whose chunks and stages are not
        the registered schedule's (one made from the schedule's name before its plugin was active:
        ``nam56r.run.activate`` lowers with the registered schedule's instance)."""
        check_lowering(self.lowering, registered_schedules=registered_schedules)
        name, pp = self.lowering.schedule, self.parallel["pp"]
        if name == "megatron" or registered_schedules.get(name) is None:
            return
        schedule = resolve_schedule(name, pp=pp, registered=registered_schedules)
        stage_map = tuple(tuple(schedule.stage_of(r, c, pp) for c in range(schedule.chunks_per_rank))
                          for r in range(pp))
        if stage_map != self.lowering.stage_map:
            raise ConfigError(f"the model was lowered for stages {[list(r) for r in self.lowering.stage_map]}, the "
                              f"registered schedule {name!r} runs {[list(r) for r in stage_map]} "
                              f"({schedule.chunks_per_rank} chunk(s) per pipeline rank)",
                              hint="lower the model with the registered schedule's instance "
                                   "(nam56r.megatron.lower(..., schedule=...)); nam56r.run.activate does")

    def transformer_config(self):
        return transformer_config(self.lowering)

    def build(self, config, pg_collection, device: torch.device, chunk: int = 0) -> nn.Module:
        """This rank's model chunk ``chunk`` (the stage ``lowering.stage_map`` gives it) on ``device``, every
        weight filled from nam's state."""
        from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

        from nam56r.model import build_model as build_nam_model

        lowering = self.lowering
        dsa_ranks = {layer["layer_number"]: layer["dsa_rank"] for layer in lowering.layers if layer["megatron"] == "D"}
        slots = Slots(self.cfg, self.backends, dsa_ranks, device=device,  # nam blocks are built on the GPU directly
                      recompute=lowering.recompute_in_slots)
        norm = slot_class(next(s for s in lowering.slots if s.path == "final_norm"))
        build = functools.partial(nam_hybrid_model_class(), config, hybrid_stack_spec(lowering, slots), slots=slots,
                                  norm=norm, **lowering.model_args, pg_collection=pg_collection)
        if lowering.chunks == 1 and lowering.megatron_order:
            model = build(pre_process=is_pp_first_stage(pg_collection.pp),
                          post_process=is_pp_last_stage(pg_collection.pp))
        else:  # the stage the schedule names: its layers, embeddings on stage 0, output layer and MTP on the last
            stage = lowering.stage_map[pg_collection.pp.rank()][chunk]
            mine = [layer for layer in lowering.layers if layer["pp_stage"] == stage]
            last = stage == len(lowering.stage_map) * lowering.chunks - 1
            with applied(patches.lane()), patches.chosen_stage([layer["megatron"] for layer in mine],
                                                                mine[0]["index"], mtp=last and lowering.mtp_depths > 0):
                model = build(pre_process=stage == 0, post_process=last, vp_stage=chunk)
        model = model.to(device)  # Megatron's parallel layers are there already; its torch norms are not
        if self.init_from is not None:
            from nam56r.export import initial_weights

            state = {k: v.to(device) for k, v in initial_weights(self.init_from, self.cfg).items()}
        else:  # what `nam train` does before building the local model: same seed, same init, same weights
            torch.manual_seed(self.seed)
            state = build_nam_model(self.cfg, self.backends, device=device).state_dict()
        load_nam_weights(model, state, lowering, pg_collection)
        return model

    def rank_tensors(self, model: nn.Module, tensors, pg_collection) -> dict:
        """``tensors`` by nam56r's parameter names (an export's optimizer state) for this rank's chunk ``model``."""
        return for_this_rank(model, tensors, self.lowering, pg_collection)

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
