"""Per-device memory of NAM56R in either engine: the static part counted exactly, the activations from measured
per-block constants under the run's activation recompute.

Static (counted on the meta device). The megatron engine keeps, on each rank, this rank's parameters in bf16,
their gradients in fp32 buffers (``grad_reduce_in_fp32``), and its shard of the distributed optimizer's fp32
main parameters and two Adam moments. With pipeline size 1 and ``world`` ranks at expert parallelism ``ep``:

* dense parameters (everything but the routed experts) sit on every rank; the optimizer shards them over all
  ``world`` ranks;
* routed experts are split ``ep`` ways; the optimizer shards each rank's experts over the ``world / ep``
  ranks that hold the same experts.

The local engine holds everything in one process: weights, the optimizer states of ``train.optimizer_numerics``,
and gradients in the parameter dtype that exist only from the backward to the step (``set_to_none``).

Activations (measured). ``bench/activations.py`` builds ONE block of each part (a Mamba-3, MoE, DSA and MLA
layer, an MTP depth, the CE head, the embedding) at NAM56R's width on a GPU and measures, per recompute choice
and micro-batch, the bytes its forward keeps for backward, the backward's peak above that and the gradients it
leaves; its JSON is ``nam56r/activations.json`` (its ``meta`` says date, GPU, versions and the command).
``activations_by_kind`` sums the parts over the model's layers; ``backward_peak`` replays the backward in the
model's order (MTP depths, head, layers last to first, embedding): at each part the kept activations of the parts
not yet done, the gradients made so far (local engine) and that part's backward peak. The estimate of the
allocator's peak (``torch.cuda.max_memory_allocated``, what the engines log as ``mem_gib``) is the static part
plus that replay's peak; ``bench/memory_plan.py`` compares it with every measured peak. A GPU must also hold
what the process keeps outside PyTorch's allocator (``OUTSIDE_ALLOCATOR_GIB``), which the peak does not see;
``fits`` and the largest micro-batch count it.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

GIB = 2**30
BF16_WEIGHT, FP32_GRAD, FP32_OPTIMIZER = 2, 4, 12
FUSED_FP32_MASTER = "fp32-master, fused"
"""The megatron engine's key for ``fp32-master`` with ``train.fused_master_weights``."""
"""Bytes per parameter: bf16 weights; fp32 gradient buffers; fp32 main weights plus Adam's two moments."""
MEGATRON_OPTIMIZER = {"fp32-master": FP32_OPTIMIZER, FUSED_FP32_MASTER: 2 + 4 + 4, "bf16-moments": 2 + 2 + 2}
"""The distributed optimizer's bytes per parameter (``megatron_numerics``): Megatron's fp32 main weights and two
fp32 moments; Transformer Engine's FusedAdam (the precision-aware optimizer: ``train.fused_master_weights``, and
always for ``bf16-moments``) keeps each fp32 master as the 16 bits its bf16 weight lacks, with two fp32 or two
bf16 moments. The megatron engine refuses the other numerics."""

OUTSIDE_ALLOCATOR_GIB = 9.5
"""Memory a rank holds outside PyTorch's caching allocator: the CUDA context, NCCL's buffers, library
workspaces. Measured at the one out-of-memory seen, 4x H200, EP 4, MBS 4: the process held 139.40 GiB, of
which PyTorch had allocated 129.80 GiB and reserved 0.08 GiB more."""

H200_GIB = 139.8
"""An H200's memory as CUDA reports it (``total capacity of 139.80 GiB`` in that out-of-memory error)."""

MAX_MBS = 64
"""The largest micro-batch the plan searches (``largest_fitting``)."""


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


def megatron_numerics(train) -> str:
    """``MEGATRON_OPTIMIZER``'s key for ``train``: its numerics, told apart by who holds the fp32 masters."""
    fused = train.fused_master_weights and train.optimizer_numerics == "fp32-master"
    return FUSED_FP32_MASTER if fused else train.optimizer_numerics


def grad_bytes(train) -> int:
    """Bytes per parameter of the megatron engine's gradient buffers: fp32 unless ``train.grad_reduce_in_fp32``
    is off (then the parameters' dtype, bf16)."""
    return FP32_GRAD if train.grad_reduce_in_fp32 else BF16_WEIGHT


def megatron_plan(dense: int, routed: int, *, world: int, ep: int, mbs: int, other_gib: float = 0.0,
                  numerics: str = "fp32-master", grad_bytes: int = FP32_GRAD) -> MemoryPlan:
    """Peak memory per GPU at pipeline size 1: the static part (see the module docstring) and ``other_gib``,
    the activations and temporaries at the peak (``backward_peak``); ``grad_bytes``: the gradient buffers'
    bytes per parameter (``grad_bytes(train)``)."""
    if world < 1 or ep < 1 or world % ep or mbs < 1:
        raise ValueError(f"world={world}, ep={ep}, mbs={mbs}: need world, ep, mbs >= 1 and ep dividing world")
    local = dense + routed / ep
    sharded = dense / world + routed / world  # experts: routed/ep over world/ep ranks
    return MemoryPlan(world=world, ep=ep, mbs=mbs, local_params=local, weights_gib=BF16_WEIGHT * local / GIB,
                      grads_gib=grad_bytes * local / GIB, optimizer_gib=MEGATRON_OPTIMIZER[numerics] * sharded / GIB,
                      other_gib=other_gib)


def megatron_estimate(cfg, *, world: int, ep: int, mbs: int, kinds: tuple[str, ...], numerics: str = "fp32-master",
                      split: tuple[int, int] | None = None,
                      grad_bytes: int = FP32_GRAD) -> tuple[MemoryPlan, dict[str, dict]]:
    """The megatron engine's per-GPU plan of ``cfg`` at ``world`` ranks, expert parallelism ``ep``, micro-batch
    ``mbs`` and the recompute ``kinds`` (expanded), with its activation rows (``activations_by_kind``): what
    ``--dry-run`` prints for that layout (cli/plan.py) and what ``bench/megatron.py memory`` measures against on
    one GPU at the same per-GPU shapes. The gradients are fp32 buffers, static: none are made in the backward.
    ``cfg`` must have ``MEASURED_SHAPE``."""
    dense, routed = split or parameter_split(cfg)
    peak = backward_peak(cfg, kinds, mbs, grads=False)
    plan = megatron_plan(dense, routed, world=world, ep=ep, mbs=mbs, numerics=numerics, other_gib=peak["peak_gib"],
                         grad_bytes=grad_bytes)
    return plan, peak["rows"]


def largest_mbs(cfg, *, world: int, ep: int, kinds: tuple[str, ...] = (), capacity_gib: float = H200_GIB,
                numerics: str = "fp32-master", split: tuple[int, int] | None = None,
                grad_bytes: int = FP32_GRAD) -> int:
    """The largest micro-batch whose megatron plan (``megatron_estimate``) ``fits`` a GPU of ``capacity_gib``."""
    split = split or parameter_split(cfg)
    return largest_fitting(lambda m: megatron_estimate(cfg, world=world, ep=ep, mbs=m, kinds=kinds, numerics=numerics,
                                                       split=split, grad_bytes=grad_bytes)[0].fits(capacity_gib))


def largest_fitting(fits: Callable[[int], bool], limit: int = MAX_MBS) -> int:
    """The largest micro-batch ``m <= limit`` with ``fits(m)`` (0 if not even 1 fits): memory grows with ``m``,
    so the search stops at the first that does not fit."""
    best = 0
    for m in range(1, limit + 1):
        if not fits(m):
            break
        best = m
    return best


MEASURED_SHAPE = {"hidden": 4096, "seq_len": 4096, "num_layers": 52}
"""The model shape the activation constants were measured at (the ``nam56r`` recipe; ``activations.json``'s
``meta.shape`` must say the same). Activations grow with width, length and depth, so at any other shape they are
not estimated: only the static part is, which is counted exactly."""


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


# --- activations by part, measured per recompute choice (bench/activations.py) ----------------------------

ACTIVATIONS = Path(__file__).with_name("activations.json")
"""``bench/activations.py``'s JSON from one GPU at ``MEASURED_SHAPE``: the constants the plan reads (its ``meta``
has the date, GPU, versions and command; bench/README.md has the table)."""

PARTS = ("mamba", "moe", "dsa", "mla", "mtp", "head", "embedding")
"""What the plan sums: a layer of each kind (``LayerSpec.kind``), an MTP depth, the CE head, the embedding."""

RECOMPUTED_BY = {"mamba": ("mamba", "mamba-scan", "layer"), "moe": ("moe", "layer"), "dsa": ("attention", "layer"),
                 "mla": ("attention", "layer"), "mtp": ("attention", "layer"), "head": (), "embedding": ()}
"""The recompute kinds that change what a part keeps (``nam56r.recompute.apply``: an MTP depth's attention layer
is marked too; the head and the embedding never are). tests/test_memory.py checks it against the bench's rows."""


@dataclass(frozen=True)
class Line:
    """Bytes as ``fixed + per_sequence * mbs``: fitted through the micro-batches measured (one: through 0)."""

    fixed: float
    per_sequence: float

    def at(self, mbs: int) -> float:
        return self.fixed + self.per_sequence * mbs

    @staticmethod
    def fit(points: list[tuple[int, float]]) -> "Line":
        if len({b for b, _ in points}) < 2:
            return Line(0.0, sum(v / b for b, v in points) / len(points))
        n = len(points)
        mb, mv = sum(b for b, _ in points) / n, sum(v for _, v in points) / n
        slope = sum((b - mb) * (v - mv) for b, v in points) / sum((b - mb) ** 2 for b, _ in points)
        return Line(mv - slope * mb, slope)


@dataclass(frozen=True)
class Measured:
    """One part under one recompute choice (``bench/activations.py`` rows, fitted over the micro-batches)."""

    kept: Line
    backward_extra: Line
    grad_bytes: float
    shared_grad_bytes: float


@dataclass(frozen=True)
class Constants:
    meta: dict
    parts: dict[tuple[str, str], Measured]
    """(part, choice) -> what it keeps (choice: ``none`` or one recompute kind)."""

    def get(self, part: str, choice: str) -> Measured:
        if (part, choice) not in self.parts:
            raise KeyError(f"{ACTIVATIONS.name} has no row for part {part!r} under recompute {choice!r}; measured: "
                           f"{sorted(self.parts)}; rerun: {self.meta.get('command', 'python bench/activations.py')}")
        return self.parts[part, choice]


def constants_from(data: dict) -> Constants:
    """``Constants`` of a ``bench/activations.py`` JSON (its ``meta`` and ``rows``). Refuses CPU rows (a lower
    count, not constants) and a shape other than ``MEASURED_SHAPE``."""
    meta = data["meta"]
    if not str(meta.get("meter", "")).startswith("torch.cuda"):
        raise ValueError(f"activation constants must be measured on a GPU (torch.cuda.memory_allocated); found "
                         f"meter {meta.get('meter')!r}")
    if meta.get("shape") != MEASURED_SHAPE:
        raise ValueError(f"activation constants measured at {meta.get('shape')}, expected {MEASURED_SHAPE}")
    grouped: dict[tuple[str, str], list[dict]] = {}
    for row in data["rows"]:
        grouped.setdefault((row["part"], row["choice"]), []).append(row)
    parts = {key: Measured(kept=Line.fit([(r["batch"], r["kept_bytes"]) for r in rows]),
                           backward_extra=Line.fit([(r["batch"], r["backward_extra_bytes"]) for r in rows]),
                           grad_bytes=max(r["grad_bytes"] for r in rows),
                           shared_grad_bytes=max(r["shared_grad_bytes"] for r in rows))
             for key, rows in grouped.items()}
    return Constants(meta=meta, parts=parts)


@functools.lru_cache(maxsize=None)
def load_constants(path: Path = ACTIVATIONS) -> Constants:
    """The checked-in constants (``ACTIVATIONS``); a ``NamError`` (exit 1) naming the file and how to remake it
    when it is missing or not a GPU's measurement at ``MEASURED_SHAPE``."""
    from nam_core.errors import NamError

    remake = "on one GPU: python bench/activations.py --batch 4 --json nam56r/activations.json (bench/README.md)"
    try:
        return constants_from(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise NamError(f"the memory plan's activation constants: expected {path}, found no such file (an install "
                       "without nam56r's package data?)", hint=f"reinstall nam-train, or remake it {remake}") from None
    except (ValueError, KeyError) as e:
        raise NamError(f"the memory plan's activation constants in {path}: {e}", hint=f"remake them {remake}") from e


def part_counts(cfg) -> dict[str, int]:
    """How many of each part ``cfg``'s model has: its layers by kind, its MTP depths, one head, one embedding."""
    from nam56r.pattern import resolve

    layers = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks).counts()
    return {**{k: layers.get(k, 0) for k in ("mamba", "moe", "dsa", "mla")}, "mtp": cfg.mtp_depths, "head": 1,
            "embedding": 1}


def choice_for(part: str, kinds: tuple[str, ...]) -> str:
    """The recompute choice that decides what ``part`` keeps under the recompute ``kinds`` (expanded): the one
    kind of ``kinds`` that reaches it (``RECOMPUTED_BY``; the config allows no two), else ``none``."""
    reaching = [k for k in kinds if k in RECOMPUTED_BY[part]]
    return reaching[0] if reaching else "none"


def activations_by_kind(cfg, kinds: tuple[str, ...], mbs: int, *, constants: Constants | None = None) -> dict:
    """Part -> what its forward keeps at micro-batch ``mbs`` under the recompute ``kinds``: ``layers`` (how many
    in the model), ``choice`` (the measured row it uses), ``recomputed``, ``gib`` (all of them), ``gib_per_layer``
    and ``without_recompute_gib`` (all of them, no recompute)."""
    c = constants or load_constants()
    rows = {}
    for part, n in part_counts(cfg).items():
        if not n:
            continue
        choice = choice_for(part, kinds)
        one = c.get(part, choice).kept.at(mbs) / GIB
        rows[part] = {"layers": n, "choice": choice, "recomputed": choice != "none", "gib": n * one,
                      "gib_per_layer": one, "without_recompute_gib": n * c.get(part, "none").kept.at(mbs) / GIB}
    return rows


def parameters_by_part(cfg) -> dict[str, tuple[int, int]]:
    """Part -> (dense, routed-expert) parameters, from the model on the meta device: the layers by kind, the MTP
    depths, the head (with the final norm), the embedding (with the n-gram hash and structure embeddings). The
    parts add up to ``parameter_split``."""
    from nam56r.model import build_model

    model = build_model(cfg, device="meta")
    out = {p: [0, 0] for p in PARTS}
    for layer in model.layers:
        for name, p in layer.named_parameters():
            out[layer.spec.kind][1 if name in ("mixer.w_gate_up", "mixer.w_down") else 0] += p.numel()
    out["mtp"][0] = sum(p.numel() for p in model.mtp.parameters())
    out["head"][0] = model.final_norm.weight.numel() + (model.head.numel() if model.head is not None else 0)
    out["embedding"][0] = sum(p.numel() for m in (model.embed, model.ngram, model.structure) if m is not None
                              for p in m.parameters())
    return {k: (d, r) for k, (d, r) in out.items()}


def static_by_part(split: dict[str, tuple[int, int]], *, engine: str, numerics: str, dtype_bytes: int = 2,
                   world: int = 1, ep: int = 1, grad_bytes: int = FP32_GRAD) -> dict[str, dict]:
    """Part -> parameters on this device and GiB of weights, gradients and optimizer states, as the engine keeps
    them (the module docstring): the megatron engine per rank (experts split ``ep`` ways, the optimizer sharded),
    the local engine whole (its gradients exist from the backward to the step)."""
    from nam_core.engine.numerics import STATE_BYTES

    rows = {}
    for part, (dense, routed) in split.items():
        if engine == "megatron":
            local = dense + routed / ep
            rows[part] = {"parameters": local, "weights_gib": BF16_WEIGHT * local / GIB,
                          "grads_gib": grad_bytes * local / GIB,
                          "optimizer_gib": MEGATRON_OPTIMIZER[numerics] * (dense + routed) / world / GIB}
        else:
            n = dense + routed
            state = STATE_BYTES[numerics] if dtype_bytes == 2 else 8
            rows[part] = {"parameters": n, "weights_gib": dtype_bytes * n / GIB, "grads_gib": dtype_bytes * n / GIB,
                          "optimizer_gib": state * n / GIB}
    return rows


def backward_order(cfg) -> list[str]:
    """The parts in the order the backward reaches them: the MTP depths (last first), the head, the layers last
    to first, the embedding."""
    from nam56r.pattern import resolve

    layers = [spec.kind for spec in resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks).layers]
    return ["mtp"] * cfg.mtp_depths + ["head"] + layers[::-1] + ["embedding"]


def backward_peak(cfg, kinds: tuple[str, ...], mbs: int, *, grads: bool, constants: Constants | None = None) -> dict:
    """The activations' and temporaries' peak of one step at micro-batch ``mbs`` (GiB; what the allocator holds
    on top of the static part), by replaying the backward (``backward_order``): at each part, the kept bytes of
    every part not yet done, the gradients made so far when ``grads`` (the local engine; the megatron engine's
    are static fp32 buffers), and the part's own backward peak (its measured ``backward_extra``, less the shared
    embedding and head gradients once they exist). ``peak_gib`` and the part it is at (``peak_at``),
    ``activations_gib`` (all kept at the end of the forward) and ``rows`` (``activations_by_kind``)."""
    c = constants or load_constants()
    rows = activations_by_kind(cfg, kinds, mbs, constants=c)
    live = sum(r["gib"] for r in rows.values()) * GIB
    made, shared_made, peak, at = 0.0, False, 0.0, None
    for part in backward_order(cfg):
        m = c.get(part, rows[part]["choice"])
        extra = m.backward_extra.at(mbs) - (m.shared_grad_bytes if shared_made else 0.0)
        here = live + (made if grads else 0.0) + extra
        if here > peak:
            peak, at = here, part
        live -= m.kept.at(mbs)
        made += m.grad_bytes + (0.0 if shared_made else m.shared_grad_bytes)
        shared_made = shared_made or m.shared_grad_bytes > 0
    return {"peak_gib": peak / GIB, "peak_at": at, "activations_gib": sum(r["gib"] for r in rows.values()),
            "rows": rows}


def local_plan(params: int, dtype_bytes: int, *, numerics: str, mbs: int, cfg, kinds: tuple[str, ...],
               constants: Constants | None = None) -> dict:
    """The local engine's peak: the larger of the backward's (weights and optimizer states held, plus
    ``backward_peak`` with the gradients it makes) and the optimizer step's (weights, optimizer states and the
    gradients it reads: fp32 with fp32 masters)."""
    static = local_static_gib(params, dtype_bytes, numerics)
    held = static["weights_gib"] + static["optimizer_gib"]
    peak = backward_peak(cfg, kinds, mbs, grads=True, constants=constants)
    backward = held + peak["peak_gib"]
    step = held + params * (4 if dtype_bytes == 4 or numerics in ("fp32-master", "bf16-moments") else 2) / GIB
    return {**static, "other_gib": max(backward, step) - held, "total_gib": max(backward, step),
            "activations_gib": peak["activations_gib"], "rows": peak["rows"],
            "peak_at": f"backward, at the {peak['peak_at']} part" if backward >= step else "optimizer step"}


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
                               numerics=megatron_numerics(train), grad_bytes=grad_bytes(train)).static_gib
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
