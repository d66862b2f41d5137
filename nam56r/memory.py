"""Per-GPU memory of NAM56R under the megatron engine: the static part counted exactly, the rest measured.

The megatron engine (nam_core/engine/megatron.py) keeps, on each rank, this rank's parameters in bf16, their
gradients in fp32 buffers (``grad_reduce_in_fp32``), and its shard of the distributed optimizer's fp32 main
parameters and two Adam moments. With pipeline size 1 and ``world`` ranks at expert parallelism ``ep``:

* dense parameters (everything but the routed experts) sit on every rank; the optimizer shards them over all
  ``world`` ranks;
* routed experts are split ``ep`` ways; the optimizer shards each rank's experts over the ``world / ep``
  ranks that hold the same experts.

Everything else (activations, the optimizer step's temporaries, the allocator's slack) is not modelled. It is
measured, as a fixed part plus a part per sequence of the micro-batch (``OTHER_GIB_FIXED``,
``OTHER_GIB_PER_SEQUENCE``), fitted to real runs' peaks (``torch.cuda.max_memory_allocated``) minus their
static part. ``total_gib`` is that peak. A GPU must also hold what the process keeps outside PyTorch's
allocator (``OUTSIDE_ALLOCATOR_GIB``), which the peak does not see; ``fits`` and ``largest_mbs`` count it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

GIB = 2**30
BF16_WEIGHT, FP32_GRAD, FP32_OPTIMIZER = 2, 4, 12
"""Bytes per parameter: bf16 weights; fp32 gradient buffers; fp32 main weights plus Adam's two moments."""
MEGATRON_OPTIMIZER = {"fp32-master": FP32_OPTIMIZER, "bf16-moments": 4 + 2 + 2}
"""The distributed optimizer's bytes per parameter under ``train.optimizer_numerics`` (fp32 main weights; two
fp32 or two bf16 moments). The megatron engine refuses the other numerics."""

OTHER_GIB_PER_SEQUENCE = 22.95
OTHER_GIB_FIXED = 2.8
"""Measured 2026-11-22 on 4x H200, NAM56R at sequence 4096, megatron engine, PP 1, EP 4
(bench/results/megatron_throughput_x4.json and megatron_throughput_x4_mbs.json): peaks 62.5, 85.3 and
108.4 GiB at MBS 1, 2 and 3 over a static part of 36.7 GiB, so 22.95 GiB per sequence and 2.8 GiB fixed.
Fitted at EP 4 only; the 1-GPU (EP 1) and 2-GPU (EP 2, MBS 1 and 2) peaks of the same session are
predictions it meets within 1 GiB (tests/test_memory.py)."""

OUTSIDE_ALLOCATOR_GIB = 9.5
"""Memory a rank holds outside PyTorch's caching allocator: the CUDA context, NCCL's buffers, library
workspaces. Measured at the one out-of-memory seen, 4x H200, EP 4, MBS 4: the process held 139.40 GiB, of
which PyTorch had allocated 129.80 GiB and reserved 0.08 GiB more."""

H200_GIB = 139.8
"""An H200's memory as CUDA reports it (``total capacity of 139.80 GiB`` in that out-of-memory error)."""


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
        """The planned peak of PyTorch's allocator (what the engines log as ``mem_gib``)."""
        return self.static_gib + self.other_gib

    def fits(self, capacity_gib: float = H200_GIB) -> bool:
        """Whether the peak and the memory outside the allocator fit a GPU of ``capacity_gib``."""
        return self.total_gib + OUTSIDE_ALLOCATOR_GIB <= capacity_gib

    def to_dict(self) -> dict:
        return {"world": self.world, "ep": self.ep, "mbs": self.mbs, "local_params": self.local_params,
                "weights_gib": self.weights_gib, "grads_gib": self.grads_gib, "optimizer_gib": self.optimizer_gib,
                "static_gib": self.static_gib, "other_gib": self.other_gib, "total_gib": self.total_gib}


def megatron_plan(dense: int, routed: int, *, world: int, ep: int, mbs: int,
                  other_gib_per_sequence: float = OTHER_GIB_PER_SEQUENCE,
                  other_gib_fixed: float = OTHER_GIB_FIXED, numerics: str = "fp32-master") -> MemoryPlan:
    """Peak memory per GPU at pipeline size 1 (see the module docstring for what is counted and what measured).
    ``other_gib_per_sequence``: the activations of one sequence (``activations_by_kind`` under recompute)."""
    if world < 1 or ep < 1 or world % ep or mbs < 1:
        raise ValueError(f"world={world}, ep={ep}, mbs={mbs}: need world, ep, mbs >= 1 and ep dividing world")
    local = dense + routed / ep
    sharded = dense / world + routed / world  # experts: routed/ep over world/ep ranks
    return MemoryPlan(world=world, ep=ep, mbs=mbs, local_params=local, weights_gib=BF16_WEIGHT * local / GIB,
                      grads_gib=FP32_GRAD * local / GIB, optimizer_gib=MEGATRON_OPTIMIZER[numerics] * sharded / GIB,
                      other_gib=other_gib_fixed + other_gib_per_sequence * mbs)


def megatron_estimate(cfg, *, world: int, ep: int, mbs: int, kinds: tuple[str, ...], numerics: str = "fp32-master",
                      split: tuple[int, int] | None = None) -> tuple[MemoryPlan, dict[str, dict]]:
    """The megatron engine's per-GPU plan of ``cfg`` at ``world`` ranks, expert parallelism ``ep``, micro-batch
    ``mbs`` and the recompute ``kinds`` (expanded), with its activation rows (``activations_by_kind``): what
    ``--dry-run`` prints for that layout (cli/plan.py) and what ``bench/megatron.py memory`` measures against on
    one GPU at the same per-GPU shapes. ``cfg`` must have ``MEASURED_SHAPE``."""
    dense, routed = split or parameter_split(cfg)
    rows = activations_by_kind(cfg, kinds, per_sequence=OTHER_GIB_PER_SEQUENCE)
    plan = megatron_plan(dense, routed, world=world, ep=ep, mbs=mbs, numerics=numerics,
                         other_gib_per_sequence=per_sequence_gib(rows))
    return plan, rows


def largest_mbs(dense: int, routed: int, *, world: int, ep: int, capacity_gib: float = H200_GIB,
                per_sequence: float = OTHER_GIB_PER_SEQUENCE, numerics: str = "fp32-master") -> int:
    """The largest micro-batch whose plan ``fits`` a GPU of ``capacity_gib`` (0 if not even MBS 1 fits)."""
    base = megatron_plan(dense, routed, world=world, ep=ep, mbs=1, other_gib_per_sequence=0,
                         numerics=numerics).total_gib
    return max(0, math.floor((capacity_gib - OUTSIDE_ALLOCATOR_GIB - base) / per_sequence))


MEASURED_SHAPE = {"hidden": 4096, "seq_len": 4096, "num_layers": 52}
"""The model shape ``OTHER_GIB_FIXED`` and ``OTHER_GIB_PER_SEQUENCE`` were measured at (the ``nam56r`` recipe).
Activations grow with width, length and depth, so at any other shape they are not estimated: only the static
part is, which is counted exactly."""


def activations_measured(cfg) -> bool:
    """Whether ``cfg`` has the shape the activation constants were measured at (``MEASURED_SHAPE``)."""
    return all(getattr(cfg, k) == v for k, v in MEASURED_SHAPE.items())


def local_static_gib(params: int, dtype_bytes: int, numerics: str = "bf16") -> dict[str, float]:
    """The local engine's static memory: weights and gradients in the training dtype, and the optimizer's states
    under ``train.optimizer_numerics`` (nam_core/engine/numerics.py ``STATE_BYTES``; a float32 run's parameters
    are their own masters: two fp32 moments). One process holds everything: nothing is sharded."""
    from nam_core.engine.numerics import STATE_BYTES

    weights = params * dtype_bytes / GIB
    state = STATE_BYTES[numerics] if dtype_bytes == 2 else 8
    optimizer = params * state / GIB
    return {"weights_gib": weights, "grads_gib": weights, "optimizer_gib": optimizer,
            "static_gib": 2 * weights + optimizer}


LOCAL_GIB_PER_SEQUENCE = 21.27
LOCAL_GIB_FIXED = 4.4
"""The local engine's activations at NAM56R's shape (``MEASURED_SHAPE``), one H200: peaks 72.2 and 114.8 GiB at
MBS 2 and 4 (bench/results/megatron_throughput_h200_1gpu.json, megatron_throughput_h200_local_mbs4.json; bf16
parameters and moments) over weights and moments of 26.4 GiB: 21.27 GiB per sequence, 4.4 GiB fixed. The
gradients are not in that peak's static part: the backward allocates them as it frees activations."""


# --- activations by block kind, under activation recompute (estimates until measured) ---------------------

KINDS = ("mamba", "moe", "attention")
"""Recompute kinds by layer kind (nam56r/recompute.py ``KIND_OF_LAYER``)."""


def kept_bytes_per_token(cfg) -> dict[str, tuple[int, float]]:
    """Kind -> (layers, bytes per token one layer keeps for backward without recompute), by an analytic model:
    every matrix keeps its input and its output for backward (bf16, 2 bytes each); a routed expert matrix
    ``[E, a, b]`` does so for each of the ``moe_topk`` experts a token visits. It counts what sizes the layers
    in proportion to one another; ``activations_by_kind`` scales it to the measured total."""
    from nam56r.model import build_model
    from nam56r.recompute import KIND_OF_LAYER

    totals: dict[str, list] = {}
    for layer in build_model(cfg, device="meta").layers:
        per_token = 0
        for p in layer.parameters():
            if p.ndim == 2:
                per_token += p.shape[0] + p.shape[1]
            elif p.ndim == 3:
                per_token += cfg.moe_topk * (p.shape[1] + p.shape[2])
        row = totals.setdefault(KIND_OF_LAYER[layer.spec.kind], [0, 0])
        row[0] += 1
        row[1] += 2 * per_token
    return {k: (n, total / n) for k, (n, total) in totals.items()}


def activations_by_kind(cfg, kinds: tuple[str, ...], *, per_sequence: float) -> dict[str, dict]:
    """GiB of activations per sequence by recompute kind (``mamba``, ``moe``, ``attention``) under the recompute
    ``kinds``, and ``replay``: the one layer a recompute rebuilds at a time in backward. ESTIMATES until measured
    per kind (``bench/megatron.py throughput --recompute``):

    * without recompute, the measured ``per_sequence`` (everything the run keeps for one sequence, the MTP depths
      and the CE head included) is split among the kinds in proportion to ``kept_bytes_per_token``;
    * a recomputed mixer keeps its input and its norm's input (2 x hidden bf16 per token and layer); a recomputed
      whole layer (``layer``) keeps its input (1 x hidden); a Mamba mixer under ``mamba-scan`` keeps those two,
      its in_proj output and out_proj's input (``mamba_scan_extra_per_token``);
    * the replay holds one layer of the largest recomputed kind's activations, as without recompute.
    """
    kept = kept_bytes_per_token(cfg)
    modelled = sum(n * b for n, b in kept.values()) * cfg.seq_len / GIB
    scale = per_sequence / modelled
    rows, replay = {}, 0.0
    for kind, (n, per_layer) in kept.items():
        full = n * per_layer * cfg.seq_len * scale / GIB
        scan = kind == "mamba" and "mamba-scan" in kinds and "layer" not in kinds
        recomputed = "layer" in kinds or kind in kinds or scan
        inputs = (1 if "layer" in kinds else 2) * cfg.hidden * 2 + (mamba_scan_extra_per_token(cfg) if scan else 0)
        rows[kind] = {"layers": n, "gib": n * inputs * cfg.seq_len / GIB if recomputed else full,
                      "recomputed": recomputed, "without_recompute_gib": full}
        if recomputed:
            replay = max(replay, full / n)
    rows["replay"] = {"layers": 1 if replay else 0, "gib": replay, "recomputed": False, "without_recompute_gib": 0.0}
    return rows


def mamba_scan_extra_per_token(cfg) -> int:
    """Bytes per token a Mamba-3 layer keeps under ``mamba-scan`` beyond a whole recomputed mixer's two hidden
    vectors: the in_proj output (bf16; z, x, B, C, dt, A, trap and the angles: 24,992 wide at NAM56R's width)
    and out_proj's input (d_inner), the two ends of the checkpointed part (``nam56r.blocks.mamba3``)."""
    bc = cfg.d_state * cfg.mamba_ngroups * cfg.mamba_mimo_rank
    angles = int(cfg.d_state * cfg.mamba_rope_fraction) // 2 * 2 // 2
    return 2 * (2 * cfg.d_inner + 2 * bc + 3 * cfg.mamba_heads + angles) + 2 * cfg.d_inner


def per_sequence_gib(rows: dict[str, dict]) -> float:
    """One sequence's activations under a recompute choice (``activations_by_kind``)."""
    return sum(r["gib"] for r in rows.values())


def local_plan(params: int, dtype_bytes: int, *, numerics: str, mbs: int, per_sequence: float) -> dict:
    """The local engine's peak: the larger of the backward's (weights, optimizer states, activations; the
    gradients replace freed activations, ``LOCAL_GIB_FIXED``) and the optimizer step's (weights, optimizer
    states, the gradients it reads: fp32 with fp32 masters)."""
    static = local_static_gib(params, dtype_bytes, numerics)
    held = static["weights_gib"] + static["optimizer_gib"]
    grads = params * (4 if dtype_bytes == 4 or numerics in ("fp32-master", "bf16-moments") else 2) / GIB
    backward = held + LOCAL_GIB_FIXED + per_sequence * mbs
    step = held + grads
    return {**static, "other_gib": per_sequence * mbs + LOCAL_GIB_FIXED, "total_gib": max(backward, step),
            "peak_at": "backward" if backward >= step else "optimizer step"}


# --- before anything is allocated or written: can this run fit at all? ----------------------------------

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def machine_ram_bytes() -> int:
    """This machine's physical memory: what a CPU run must fit in."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def lower_bound_gib(cfg, train, *, devices: int = 1) -> dict[str, float]:
    """What the run needs per device at the very least, counted without building anything (so no size is too
    big to count): the embedding table (vocab x hidden) and one norm (hidden) per layer, each held as weights,
    gradients and AdamW's two moments, and one ``[mbs, seq, hidden]`` activation per layer kept for backward.
    Spread evenly over ``devices`` (the megatron engine's ranks), which no layout beats. A run may need more,
    never less."""
    nbytes = DTYPE_BYTES.get(train.dtype, 4)
    params = cfg.vocab_size * cfg.hidden + cfg.num_layers * cfg.hidden
    activations = train.micro_batch_size * cfg.seq_len * cfg.hidden * cfg.num_layers * nbytes
    return {"static_gib": 4 * params * nbytes / GIB / devices, "activations_gib": activations / GIB / devices}


def largest_capacity_bytes(train) -> int:
    """The most memory any one device of the run could have, before the device is probed: this machine's RAM
    on the CPU; on a GPU the largest of nam's device profiles (nam_core/device.py)."""
    if train.device == "cpu":
        return machine_ram_bytes()
    from nam_core.device import PROFILES

    return max(d.memory_bytes for d in PROFILES.values() if d.memory_bytes)


def check_lower_bound(cfg, train, *, world: int = 1) -> None:
    """ConfigError (exit 2) when even ``lower_bound_gib`` exceeds ``largest_capacity_bytes``: run by the
    composition root before the layer pattern is resolved (a billion layers would take minutes to list)."""
    if min(cfg.vocab_size, cfg.hidden, cfg.num_layers, cfg.seq_len, train.micro_batch_size) < 1:
        return  # out of its bound: check_values names the field
    capacity = largest_capacity_bytes(train)
    bound = lower_bound_gib(cfg, train, devices=world)
    if bound["static_gib"] + bound["activations_gib"] > capacity / GIB:
        where = "this machine's RAM" if train.device == "cpu" else "the largest GPU nam knows"
        raise _too_big({**bound, "exact": False}, f"{where} ({capacity / GIB:.1f} GiB)", cfg, train, "at least")


def check_fits(spec, device) -> dict:
    """ConfigError (exit 2) with the plan's numbers when the run cannot fit one ``device`` (a CPU: this machine's
    RAM); else the plan. First the lower bound (cheap at any size), then the static part counted exactly on the
    meta device (weights, gradients, optimizer; as ``cli/plan.py`` shows it), plus the activation bound."""
    from nam_core.errors import ConfigError

    cfg, train, lay = spec.model, spec.train, spec.layout
    megatron = spec.engine == "megatron"
    capacity = device.memory_bytes if device.memory_bytes else (machine_ram_bytes() if device.kind == "cpu" else None)
    where = (f"{device.name} ({capacity / GIB:.1f} GiB{' of RAM' if device.kind == 'cpu' else ''})"
             if capacity else device.name)
    bound = lower_bound_gib(cfg, train, devices=lay.world_size if megatron else 1)
    plan = {"capacity_gib": capacity / GIB if capacity else None, **bound, "exact": False}
    if capacity and bound["static_gib"] + bound["activations_gib"] > capacity / GIB:
        raise _too_big(plan, where, cfg, train, "at least")
    try:
        dense, routed = parameter_split(cfg)
    except RuntimeError as e:  # a tensor whose byte size overflows int64 ("Storage size calculation overflowed")
        raise ConfigError(f"the model is too big to build: {str(e).splitlines()[0]}",
                          hint=_smaller(cfg, train)) from e
    if megatron:
        static = megatron_plan(dense, routed, world=lay.world_size, ep=lay.ep, mbs=train.micro_batch_size,
                               other_gib_per_sequence=0.0, other_gib_fixed=0.0,
                               numerics=train.optimizer_numerics).static_gib
    else:
        static = local_static_gib(dense + routed, DTYPE_BYTES.get(train.dtype, 4),
                                  train.optimizer_numerics)["static_gib"]
    plan.update(static_gib=static, parameters=dense + routed, exact=True)
    if capacity and static + bound["activations_gib"] > capacity / GIB:
        raise _too_big(plan, where, cfg, train, "")
    return plan


def _too_big(plan: dict, where: str, cfg, train, at_least: str):
    from nam_core.errors import ConfigError

    params = f"{plan['parameters']:,} parameters: " if plan.get("parameters") else ""
    need = plan["static_gib"] + plan["activations_gib"]
    return ConfigError(
        f"the run cannot fit {where}: it needs {at_least + ' ' if at_least else ''}{need:,.1f} GiB per device "
        f"({params}weights, gradients and optimizer {'at least ' if not plan['exact'] else ''}"
        f"{plan['static_gib']:,.1f} GiB + activations at least {plan['activations_gib']:,.1f} GiB at "
        f"micro-batch {train.micro_batch_size}, seq_len {cfg.seq_len}, hidden {cfg.hidden}, "
        f"num_layers {cfg.num_layers}, vocab_size {cfg.vocab_size}); nothing was written",
        hint=_smaller(cfg, train))


def _smaller(cfg, train) -> str:
    return ("lower the sizes (hidden, num_layers, vocab_size, seq_len, train.micro_batch_size, num_experts, "
            "moe_ffn_hidden, attn_heads, d_state) or train on a bigger device; a recipe's sizes: "
            "nam recipe show nam56r-tiny")
