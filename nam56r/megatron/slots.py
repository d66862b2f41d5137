"""The adapters that put nam blocks into Megatron's slots (each slot's call signature, §1.4), and ``Slots``,
what the adapters of one model chunk share. The lowering names them (``Slot.adapter``); the spec builds them."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Mapping, Sequence

import torch
from torch import nn

from nam56r.recompute import checkpointed, mark_scan, replaying
from nam_core.errors import NamError


class Slots:
    """What every nam adapter of one model chunk shares: the nam config and backends, the DSA rank of each
    Megatron ``layer_number``, the device nam blocks are built on, the ``ForwardState`` of the forward in
    flight, and this step's aux-loss sums and log lines; the recompute kinds the adapters run under
    ``nam56r.recompute.checkpointed`` (``Lowering.recompute_in_slots``)."""

    def __init__(self, cfg, backends, dsa_ranks: Mapping[int, int], device: torch.device | str = "cpu",
                 recompute: Sequence[str] = ()):
        self.cfg, self.backends, self.dsa_ranks, self.device = cfg, backends, dict(dsa_ranks), torch.device(device)
        self.recompute = frozenset(recompute)
        self.state = None
        self.ran: set[int] = set()
        self.aux: dict[str, torch.Tensor] = {}
        self.notes: list[str] = []

    def start(self, state) -> None:
        """A new forward begins: keep the finished one's log lines (blocks' ``ForwardState.log``)."""
        if self.state is not None:
            self.notes.extend(self.state.log)
        self.state = state
        self.ran = set()

    def replay(self, adapter: nn.Module) -> bool:
        """Whether ``adapter`` already ran in this forward: Megatron's full recompute (``train.recompute=layer``)
        runs each layer's forward again inside backward, and nam's blocks must know (``nam56r.recompute``)."""
        again = id(adapter) in self.ran
        self.ran.add(id(adapter))
        return again

    def run(self, kind: str, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``block(x, state)``, under nam's recompute when ``kind`` is one of the slots' recompute kinds."""
        if kind in self.recompute:
            return checkpointed(block, self.state, x)
        return block(x, self.state)

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
        mark_scan(self.block, nam.recompute)  # train.recompute=mamba-scan: the mixer checkpoints itself

    def forward(self, hidden_states, inference_context=None, packed_seq_params=None):
        _refuse_unsupported(inference_context, packed_seq_params)
        replay = self.nam.replay(self)
        with replaying(self.nam.state) if replay and self.nam.state is not None else nullcontext():
            out = self.nam.run("mamba", self.block, hidden_states.transpose(0, 1))  # [b, s, h]
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
                self.block = DSA(nam.cfg, backends.attention, backends.indexer, dsa_rank=nam.dsa_ranks[layer_number],
                                 indexer_kernels=backends.indexer_kernels)
            else:
                self.block = MLA(nam.cfg, backends.attention)

    def forward(self, hidden_states, attention_mask=None, inference_context=None, packed_seq_params=None,
                **unused):  # rotary_pos_emb/cos/sin, attention_bias, sequence_len_offset: None here (MLA ropes itself)
        _refuse_unsupported(inference_context, packed_seq_params)
        state = self.nam.state
        replay = self.nam.replay(self)  # the replay re-attaches its losses to the graph it rebuilds, logs none
        with replaying(state) if replay else nullcontext():
            before = {name: len(values) for name, values in state.aux_losses.items()}
            out = self.nam.run("attention", self.block, hidden_states.transpose(0, 1)).transpose(0, 1)  # [s, b, h]
            for name, values in state.aux_losses.items():
                added = values[before.get(name, 0):]
                if added:
                    loss = torch.stack(added).sum()
                    out = self.attach(out, loss)
                    if not replay:
                        self.nam.log(name, loss)
        return out, None

