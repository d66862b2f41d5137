"""Per-GPU memory of NAM56R under the megatron engine: the static part counted exactly, the rest measured.

The megatron engine (nam_core/engine/megatron.py) keeps, on each rank, this rank's parameters in bf16, their
gradients in fp32 buffers (``grad_reduce_in_fp32``), and its shard of the distributed optimizer's fp32 main
parameters and two Adam moments. With pipeline size 1 and ``world`` ranks at expert parallelism ``ep``:

* dense parameters (everything but the routed experts) sit on every rank; the optimizer shards them over all
  ``world`` ranks;
* routed experts are split ``ep`` ways; the optimizer shards each rank's experts over the ``world / ep``
  ranks that hold the same experts.

Everything else (activations, the optimizer step's temporaries, the allocator's slack) is not modelled. It is
measured: ``OTHER_GIB_PER_SEQUENCE`` is the peak of a real run minus its static part, per sequence of the
micro-batch. Scaling it with the micro-batch size is an assumption (an upper bound if part of it is fixed);
only MBS 1 has been measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
BF16_WEIGHT, FP32_GRAD, FP32_OPTIMIZER = 2, 4, 12
"""Bytes per parameter: bf16 weights; fp32 gradient buffers; fp32 main weights plus Adam's two moments."""

OTHER_GIB_PER_SEQUENCE = 25.4
"""Measured, 2026-11-22, 1x H200, NAM56R at sequence 4096, MBS 1, megatron engine with EP 1
(bench/results/megatron_throughput_x2.json): peak 104.6 GiB, static part 79.3 GiB. The same run's 2-GPU row
(EP 2, peak 76.6 GiB) is predicted to within 0.5 GiB by this constant (tests/test_memory.py)."""

H200_GIB = 139.0
"""The GPU hosts' H200 memory as the device tool states it ("about 139 GiB"); not read from a device here."""


def parameter_split(cfg) -> tuple[int, int]:
    """(dense, routed-expert) parameter counts of ``cfg``, from the model built on the meta device."""
    from nam56r.model import build_model

    dense = routed = 0
    for name, p in build_model(cfg, device="meta").named_parameters():
        if name.endswith((".mixer.w_gate_up", ".mixer.w_down")) and name.startswith("layers."):
            routed += p.numel()
        else:
            dense += p.numel()
    return dense, routed


@dataclass(frozen=True)
class MemoryPlan:
    world: int
    ep: int
    mbs: int
    local_params: float
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    other_gib: float

    @property
    def static_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib

    @property
    def total_gib(self) -> float:
        return self.static_gib + self.other_gib

    def to_dict(self) -> dict:
        return {"world": self.world, "ep": self.ep, "mbs": self.mbs, "local_params": self.local_params,
                "weights_gib": self.weights_gib, "grads_gib": self.grads_gib, "optimizer_gib": self.optimizer_gib,
                "static_gib": self.static_gib, "other_gib": self.other_gib, "total_gib": self.total_gib}


def megatron_plan(dense: int, routed: int, *, world: int, ep: int, mbs: int,
                  other_gib_per_sequence: float = OTHER_GIB_PER_SEQUENCE) -> MemoryPlan:
    """Peak memory per GPU at pipeline size 1 (see the module docstring for what is counted and what measured)."""
    if world < 1 or ep < 1 or world % ep or mbs < 1:
        raise ValueError(f"world={world}, ep={ep}, mbs={mbs}: need world, ep, mbs >= 1 and ep dividing world")
    local = dense + routed / ep
    sharded = dense / world + routed / world  # experts: routed/ep over world/ep ranks
    return MemoryPlan(world=world, ep=ep, mbs=mbs, local_params=local, weights_gib=BF16_WEIGHT * local / GIB,
                      grads_gib=FP32_GRAD * local / GIB, optimizer_gib=FP32_OPTIMIZER * sharded / GIB,
                      other_gib=other_gib_per_sequence * mbs)


def largest_mbs(dense: int, routed: int, *, world: int, ep: int, capacity_gib: float = H200_GIB,
                other_gib_per_sequence: float = OTHER_GIB_PER_SEQUENCE) -> int:
    """The largest micro-batch whose planned peak stays within ``capacity_gib`` (0 if not even MBS 1 fits)."""
    static = megatron_plan(dense, routed, world=world, ep=ep, mbs=1, other_gib_per_sequence=0).static_gib
    return max(0, math.floor((capacity_gib - static) / other_gib_per_sequence))
