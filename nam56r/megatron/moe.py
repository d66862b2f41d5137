"""nam's routed experts inside Megatron-Core's ``MoELayer`` (slot ``moe_layer.submodules.mlp``).

Megatron keeps what it does well: the router (softmax top-k, the Switch aux loss), the token dispatcher
(permutation, all-to-all over EP) and the shared expert. nam supplies the experts module: ``ExpertsSlot``
holds this rank's experts stacked (``[E_local, 2f, d]`` and ``[E_local, d, f]``, the layout of
``nam56r.blocks.moe.MoE``) and runs the run's ``moe`` backend on the dispatched rows (``MoEExperts.sorted``):
with ``moe_backend=grouped`` two grouped GEMMs per layer instead of ``SequentialMLP``'s loop over experts.

The dispatcher reads the per-expert row counts on the host once per layer call (a device-to-host copy and a
wait), because ``SequentialMLP`` splits its input by them and the all-to-all takes host split sizes. With
one expert-parallel rank and one tensor-parallel rank there is no all-to-all, the rows leave the permutation
already sorted by expert, and the experts here take counts on the device: ``LocalDispatcher`` skips the copy,
the wait and the (identity) second sort, so the MoE path makes no host sync (tests/test_megatron_engine_gpu.py
checks it with ``torch.cuda.set_sync_debug_mode("error")``). At EP > 1 the syncs Megatron needs remain: the
all-to-all's input and output split sizes and the sort of received rows by local expert are read on the host,
once per MoE layer forward (one device-to-host copy of ``[ep]`` and ``[ep, E_local]`` counts and one wait);
backward reuses the same host splits.

This module imports Megatron-Core at import: the spec builder imports it only when it builds a model.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from torch import nn


class LocalDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's all-to-all dispatcher at EP = TP = 1, the per-expert counts left on the device.

    There the all-to-all and the tensor-parallel gathers are identities and the first permutation already
    orders rows by expert (``permute`` sorts by expert, then token), so the second sort is the identity too;
    what Megatron reads on the host is needed by neither."""

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        return tokens_per_expert

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        return hidden_states


class NamMoELayer(MoELayer):
    """``MoELayer`` whose all-to-all dispatcher is ``LocalDispatcher`` where expert and tensor parallelism
    are both 1; elsewhere Megatron's own, unchanged."""

    def __init__(self, config, submodules, layer_number=None, pg_collection=None, **kwargs):
        super().__init__(config, submodules, layer_number=layer_number, pg_collection=pg_collection, **kwargs)
        local = (config.moe_token_dispatcher_type == "alltoall" and config.expert_model_parallel_size == 1
                 and config.tensor_model_parallel_size == 1 and config.expert_tensor_parallel_size == 1)
        if local:
            shared = self.token_dispatcher.shared_experts
            self.token_dispatcher = LocalDispatcher(self.num_local_experts, self.local_expert_indices,
                                                    config=self.config, pg_collection=pg_collection)
            if shared is not None:
                self.token_dispatcher.set_shared_experts(shared)


class ExpertsSlot(nn.Module):
    """``MoELayer.submodules.experts``: this rank's routed experts, stacked, on the run's ``moe`` backend.

    Built as ``(num_local_experts, config, pg_collection=, name=)``; called with the dispatched rows
    ``[r, h]`` (sorted by local expert), ``tokens_per_expert [E_local]`` and each row's gate ``[r]``;
    returns ``(rows [r, h], None)`` with the gates applied, as Megatron's experts do.
    """

    def __init__(self, num_local_experts, config, pg_collection=None, name=None, *, nam):
        super().__init__()
        cfg, dtype = nam.cfg, config.params_dtype
        f, d = cfg.moe_ffn_hidden, cfg.hidden
        self.experts = nam.backends.moe
        with nam.device:
            self.w_gate_up = nn.Parameter(torch.empty(num_local_experts, 2 * f, d, dtype=dtype))
            self.w_down = nn.Parameter(torch.empty(num_local_experts, d, f, dtype=dtype))
            self.expert_state = self.experts.layer_state(cfg)
        # Megatron reduces expert gradients over the expert-data-parallel group when experts are split over
        # ranks (``allreduce=False``), over the data-parallel group otherwise (as its own expert linears do).
        split = (config.expert_model_parallel_size > 1
                 or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        for p in (self.w_gate_up, self.w_down):
            p.allreduce = not split
        self.ep_group, self.expt_tp_group, self.expt_dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Each stacked weight as this rank's slice of the global ``[E, ...]`` tensor along its first axis
        (rows ``[ep_rank * E_local, (ep_rank + 1) * E_local)``), replicated over the expert-data-parallel
        group, so a checkpoint holds every expert once whatever the layout (Megatron's ``SequentialMLP``
        keys its experts the same way, one at a time)."""
        from megatron.core.dist_checkpointing import ShardedTensor

        expert_axis = (len(sharded_offsets), self.ep_group.rank(), self.ep_group.size())
        replica = (0, self.expt_tp_group.rank(), self.expt_dp_group.rank())
        return {f"{prefix}{name}": ShardedTensor.from_rank_offsets(
                    f"{prefix}{name}", param, *sharded_offsets, expert_axis, replica_id=replica,
                    prepend_axis_num=len(sharded_offsets))
                for name, param in (("w_gate_up", self.w_gate_up), ("w_down", self.w_down))}

    def forward(self, rows, tokens_per_expert, probs, **unused):  # output_buffer / grad_input_buffer: NCCL-EP only
        counts = tokens_per_expert.to(rows.device, non_blocking=True)  # on the host at EP > 1
        out = self.experts.sorted(rows, counts, probs, self.w_gate_up, self.w_down, self.expert_state)
        return out, None
