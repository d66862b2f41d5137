"""The DualPipeV order as plain data, the messages it exchanges, and simulators that run both.

DualPipeV is DeepSeek's DualPipe cut in half (deepseek-ai/DualPipe, ``dualpipev.py``). The model is split
into ``2P`` stages over ``P`` pipeline ranks and folded into a V: rank ``r`` holds chunk 0 = stage ``r`` and
chunk 1 = stage ``2P-1-r``. A micro-batch goes down the ranks through chunk 0 (rank 0 -> P-1), turns on rank
P-1 (its chunk 0 feeds its own chunk 1, no message) and comes back up through chunk 1 (P-1 -> 0). Rank 0's
chunk 1 is the last stage: it computes the loss, so the backward pass starts where the data came in.

Everything here is pure Python: the executor (``executor.py``) runs exactly these lists, and the tests run
the simulators over them, so a schedule that would deadlock or break a data dependency fails on a CPU.

Costs in the simulators are in units of one chunk's forward pass; a backward pass costs 2 (input and
weight gradients, the usual 2:1 ratio of backward to forward FLOPs). This schedule runs each backward whole:
DualPipe's zero-bubble split of B into input-gradient and weight-gradient parts is not done.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence, Union

from nam_core.errors import ConfigError, NamError

F, B = "F", "B"
ACT, GRAD = "act", "grad"
F_COST, B_COST = 1.0, 2.0
"""Simulated time of one chunk's forward and backward: a backward computes input and weight gradients, about
twice a forward's FLOPs."""


@dataclass(frozen=True)
class Op:
    """One compute step of one rank: the forward (F) or backward (B) of one chunk for one micro-batch."""

    kind: str
    """``F`` or ``B``."""
    chunk: int
    """0: the down leg of the V (stage = rank); 1: the up leg (stage = 2P-1-rank)."""
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}(mb {self.microbatch})"


@dataclass(frozen=True)
class Message:
    """A tensor one rank sends another: a forward's output (``act``) to the next stage, or a backward's
    input gradient (``grad``) to the previous stage. Shape and dtype are the run's fixed activation ones."""

    kind: str
    stage: int
    """The stage that produced it."""
    microbatch: int
    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, mb {self.microbatch}) {self.src}->{self.dst}"


@dataclass(frozen=True)
class Exchange:
    """One batch of point-to-point transfers (``torch.distributed.batch_isend_irecv``), waited for whole."""

    sends: tuple[Message, ...] = ()
    recvs: tuple[Message, ...] = ()


Action = Union[Op, Exchange]


class ScheduleError(NamError):
    """An order or an exchange plan that cannot run: ops missing or repeated, or a deadlock."""


# --- the V layout ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where each pipeline stage lives. ``v``: DualPipeV's two chunks per rank; ``line``: one stage per
    rank, the layout of 1F1B (used here as the baseline the README compares with)."""

    pp: int
    shape: str = "v"

    @property
    def stages(self) -> int:
        return 2 * self.pp if self.shape == "v" else self.pp

    @property
    def chunks(self) -> int:
        return 2 if self.shape == "v" else 1

    def stage(self, rank: int, chunk: int) -> int:
        return rank if chunk == 0 else 2 * self.pp - 1 - rank

    def owner(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding ``stage``."""
        if stage < self.pp:
            return stage, 0
        return 2 * self.pp - 1 - stage, 1

    def needs(self, rank: int, op: Op) -> Message | None:
        """The message ``op`` must have before it runs (it may come from this very rank: the V's turn)."""
        s = self.stage(rank, op.chunk)
        if op.kind == F and s > 0:
            return Message(ACT, s - 1, op.microbatch, self.owner(s - 1)[0], rank)
        if op.kind == B and s < self.stages - 1:
            return Message(GRAD, s + 1, op.microbatch, self.owner(s + 1)[0], rank)
        return None  # the first stage reads its input; the last stage's backward starts from its loss

    def produces(self, rank: int, op: Op) -> Message | None:
        s = self.stage(rank, op.chunk)
        if op.kind == F and s < self.stages - 1:
            return Message(ACT, s, op.microbatch, rank, self.owner(s + 1)[0])
        if op.kind == B and s > 0:
            return Message(GRAD, s, op.microbatch, rank, self.owner(s - 1)[0])
        return None


# --- the order ---------------------------------------------------------------------------------------------


def min_microbatches(pp: int) -> int:
    """``2 * pp``: rank 0 starts ``2P - 1`` chunk-0 forwards before its first loss comes back round the V
    (the fill), and its steady phase, which runs ``M - 2P + 1`` groups, must hold at least one group so that
    the fill is followed by the steady F0 B1 F1 B0 pattern the other phases assume (DeepSeek's DualPipeV
    asserts the same bound)."""
    return 2 * pp


def check_sizes(pp: int, num_microbatches: int) -> None:
    """Raise ConfigError unless ``pp`` and ``num_microbatches`` can be scheduled."""
    if pp < 2:
        raise ConfigError(f"dualpipev folds 2 x pp stages over pp ranks and needs pp >= 2, found pp={pp}",
                          hint="use --pp 2 or more, or drop --plugins dualpipev")
    need = min_microbatches(pp)
    if num_microbatches < need:
        raise ConfigError(
            f"dualpipev at pp={pp} needs at least 2 x pp = {need} micro-batches per step, found {num_microbatches} "
            f"(rank 0 starts {2 * pp - 1} forwards before its first loss returns round the V)",
            hint=f"--set train.grad_accum={need}")


def dualpipev_order(pp: int, num_microbatches: int) -> list[list[Op]]:
    """The op list of every rank, rank 0 first."""
    check_sizes(pp, num_microbatches)
    return [_rank_order(rank, pp, num_microbatches) for rank in range(pp)]


def _rank_order(rank: int, pp: int, m: int) -> list[Op]:
    """The seven phases of one rank. ``below`` counts the ranks further down the V's chunk-0 leg: a rank
    high in the V waits longest for its first chunk-1 input, so it fills more chunk-0 forwards first, and
    drains more chunk-0 backwards last."""
    below = pp - 1 - rank
    ops: list[Op] = []
    nxt = {(F, 0): 0, (F, 1): 0, (B, 0): 0, (B, 1): 0}

    def run(*steps: tuple[str, int]) -> None:
        for kind, chunk in steps:
            ops.append(Op(kind, chunk, nxt[kind, chunk]))
            nxt[kind, chunk] += 1

    f0, f1, b0, b1 = (F, 0), (F, 1), (B, 0), (B, 1)
    for _ in range(2 * below):  # 1. fill the down leg
        run(f0)
    for _ in range(rank + 1):  # 2. the first micro-batches turn: one down, one up
        run(f0, f1)
    for _ in range(below):  # 3. first backwards of the up leg
        run(b1, f1)
    for _ in range(m - 2 * pp + rank + 1):  # 4. steady: one forward and one backward of each chunk
        run(f0, b1, f1, b0)
    for _ in range(below):  # 5. no chunk-0 forward left
        run(b1, f1, b0)
    for _ in range(rank + 1):  # 6. only backwards left
        run(b1, b0)
    for _ in range(below):  # 7. drain the down leg
        run(b0)
    return ops


def one_f_one_b_order(pp: int, num_microbatches: int) -> list[list[Op]]:
    """Megatron's 1F1B on the ``line`` layout (one stage per rank): the baseline of the README's table."""
    order = []
    for rank in range(pp):
        warm = min(pp - 1 - rank, num_microbatches)
        ops = [Op(F, 0, i) for i in range(warm)]
        for i in range(num_microbatches - warm):
            ops += [Op(F, 0, warm + i), Op(B, 0, i)]
        ops += [Op(B, 0, i) for i in range(num_microbatches - warm, num_microbatches)]
        order.append(ops)
    return order


def forward_only(order: Sequence[Sequence[Op]]) -> list[list[Op]]:
    """The forwards of ``order`` in the same order (evaluation: no backward is run)."""
    return [[op for op in ops if op.kind == F] for ops in order]


def check_order(order: Sequence[Sequence[Op]], layout: Layout, num_microbatches: int, *, kinds=(F, B)) -> None:
    """Raise ScheduleError unless every rank runs each (kind, chunk, micro-batch) it owns exactly once."""
    if len(order) != layout.pp:
        raise ScheduleError(f"the order has {len(order)} rank lists, expected pp={layout.pp}")
    want = {Op(k, c, i) for k in kinds for c in range(layout.chunks) for i in range(num_microbatches)}
    for rank, ops in enumerate(order):
        seen: dict[Op, int] = defaultdict(int)
        for op in ops:
            seen[op] += 1
        missing = sorted(map(str, want - set(seen)))
        extra = sorted(str(op) for op, n in seen.items() if op not in want or n > 1)
        if missing or extra:
            raise ScheduleError(f"rank {rank} must run each of its ops once: missing {missing[:4]}, "
                                f"repeated or foreign {extra[:4]}")


# --- messages ----------------------------------------------------------------------------------------------


def exchange_plan(order: Sequence[Sequence[Op]], pp: int, *, shape: str = "v") -> list[list[Action]]:
    """Each rank's ops with the point-to-point batches between them: what the executor runs.

    The batches are placed on the timeline ``simulate`` computes for ``order`` (F = 1, B = 2). A message
    moves at a *moment* after its producer starts and no later than its consumer starts (``_moment`` picks
    the one where the two ranks meet with the least waiting). Both ranks put it in their batch of that
    moment, which each rank runs before its first op that starts at or after the moment. Hence:

    * the receiver has it before the op that needs it (that op starts no earlier than the moment), and the
      sender after the op that makes it;
    * on each link, both sides order the messages the same way (by moment, then by production), which NCCL
      needs: it matches sends to receives in issue order, with no tags;
    * no deadlock, whatever the real timings, even if every send waits for its receive: both sides of every
      message sit in the batches of one moment, and each rank runs its batches in the order of their moments,
      so the batches of the earliest unfinished moment are all posted at once and complete; by induction all
      do. ``simulate_exchanges`` checks it for the plans the tests use.
    """
    layout = Layout(pp, shape)
    sim = simulate(order, pp, shape=shape)  # raises ScheduleError if the order itself deadlocks
    starts = sim.starts
    ends = [[t + (F_COST if op.kind == F else B_COST) for t, op in zip(starts[r], order[r])] for r in range(pp)]
    consumer = [{layout.needs(r, op): i for i, op in enumerate(ops)} for r, ops in enumerate(order)]
    batches: list[dict[float, list[tuple[int, int, Message, bool]]]] = [defaultdict(list) for _ in range(pp)]
    for rank, ops in enumerate(order):
        for i, op in enumerate(ops):
            msg = layout.produces(rank, op)
            if msg is None or msg.dst == rank:
                continue  # the last stage's loss, the first stage's input gradient, or the V's turn
            c = consumer[msg.dst].get(msg)
            if c is None:
                raise ScheduleError(f"rank {msg.dst} runs no op that needs {msg}")
            moment = _moment(starts, ends, (rank, i), (msg.dst, c))
            key = (rank, i)  # production order: the same sort key on both sides of the link
            batches[rank][moment].append((*key, msg, True))
            batches[msg.dst][moment].append((*key, msg, False))
    plan = []
    for rank, ops in enumerate(order):
        pending = sorted(batches[rank].items())
        actions: list[Action] = []
        for i, op in enumerate(ops):
            while pending and pending[0][0] <= starts[rank][i]:
                actions.append(_batch(pending.pop(0)[1]))
            actions.append(op)
        actions += [_batch(entries) for _, entries in pending]
        plan.append(actions)
    return plan


def _moment(starts, ends, producer: tuple[int, int], consumer: tuple[int, int]) -> float:
    """The moment a message moves: any time after its producer starts and no later than its consumer starts
    is correct (see ``exchange_plan``); this picks the one at which, on the simulated timeline, the two ranks
    reach their batches closest together, so that the fewest ops wait (ties: the earliest)."""
    (src, p), (dst, c) = producer, consumer
    lo, hi = starts[src][p], starts[dst][c]
    candidates = sorted({t for t in (*starts[src], *starts[dst]) if lo < t <= hi} | {hi})

    def arrive_and_next(rank: int, moment: float) -> tuple[float, float]:
        """When the rank reaches its batch of ``moment`` (the end of its last op that starts before it), and
        when its next op would start on the timeline."""
        k = bisect.bisect_left(starts[rank], moment)  # ops [0, k) start before the moment
        arrive = ends[rank][k - 1] if k else 0.0
        return arrive, starts[rank][k] if k < len(starts[rank]) else arrive

    def delay(moment: float) -> float:
        (a_src, n_src), (a_dst, n_dst) = arrive_and_next(src, moment), arrive_and_next(dst, moment)
        meet = max(a_src, a_dst)
        return max(0.0, meet - n_src) + max(0.0, meet - n_dst)

    return min(candidates, key=lambda t: (delay(t), t))


def _batch(entries: list[tuple[int, int, Message, bool]]) -> Exchange:
    """One moment's batch, sends and receives each in production order (sender rank, then its op index)."""
    entries = sorted(entries, key=lambda e: (e[0], e[1]))
    return Exchange(sends=tuple(m for *_, m, out in entries if out),
                    recvs=tuple(m for *_, m, out in entries if not out))


# --- simulators --------------------------------------------------------------------------------------------


@dataclass
class Simulation:
    """What one run of an order took. Times in units of one chunk forward (F = 1, B = 2 by default)."""

    makespan: float
    busy: list[float]
    """Compute time of each rank."""
    steps: list[int]
    """Ops each rank ran."""
    peak_activations: list[float]
    """Most forward activations each rank held at once, in units of one chunk's activations (a forward
    whose backward has not run yet holds its activations)."""
    starts: list[list[float]] = field(default_factory=list)
    """When each op of each rank started, in list order."""

    @property
    def idle(self) -> list[float]:
        """Each rank's bubble: time in the step it was not computing."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Idle share of all ranks' time in the step."""
        return sum(self.idle) / (len(self.busy) * self.makespan)


def _deps(layout: Layout, rank: int, op: Op) -> list[tuple[str, int, int]]:
    """The ops (kind, stage, micro-batch) that must finish before ``op`` may start."""
    s = layout.stage(rank, op.chunk)
    if op.kind == F:
        return [(F, s - 1, op.microbatch)] if s > 0 else []
    deps = [(F, s, op.microbatch)]
    if s < layout.stages - 1:
        deps.append((B, s + 1, op.microbatch))
    return deps


def simulate(order: Sequence[Sequence[Op]], pp: int, *, shape: str = "v", f_cost: float = F_COST,
             b_cost: float = B_COST) -> Simulation:
    """Run every rank's list in order under the data dependencies alone (messages arrive as soon as they
    are produced): an F of stage s needs the F of stage s-1 (the V's turn included), a B needs its own F and
    the B of stage s+1. Raise ScheduleError on a deadlock, naming what each stuck rank waits for."""
    layout = Layout(pp, shape)
    if len(order) != pp:
        raise ScheduleError(f"the order has {len(order)} rank lists, expected pp={pp}")
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    busy = [0.0] * pp
    live = [0.0] * pp
    peak = [0.0] * pp
    pc = [0] * pp
    starts: list[list[float]] = [[] for _ in range(pp)]
    while any(pc[r] < len(order[r]) for r in range(pp)):
        progress = False
        for r in range(pp):
            while pc[r] < len(order[r]):
                op = order[r][pc[r]]
                deps = _deps(layout, r, op)
                if not all(d in done for d in deps):
                    break
                start = max([clock[r], *(done[d] for d in deps)])
                cost = f_cost if op.kind == F else b_cost
                key = (op.kind, layout.stage(r, op.chunk), op.microbatch)
                if key in done:
                    raise ScheduleError(f"rank {r} runs {op} a second time")
                done[key] = clock[r] = start + cost
                starts[r].append(start)
                busy[r] += cost
                live[r] += f_cost if op.kind == F else -f_cost
                peak[r] = max(peak[r], live[r])
                pc[r] += 1
                progress = True
        if not progress:
            stuck = [f"rank {r} at {order[r][pc[r]]} (op {pc[r]}) waits for "
                     + ", ".join(f"{k}(stage {s}, mb {m})" for k, s, m in _deps(layout, r, order[r][pc[r]])
                                 if (k, s, m) not in done)
                     for r in range(pp) if pc[r] < len(order[r])]
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    return Simulation(max(clock), busy, [len(ops) for ops in order], peak, starts)


def simulate_exchanges(plan: Sequence[Sequence[Action]], pp: int, *, f_cost: float = F_COST,
                       b_cost: float = B_COST) -> Simulation:
    """Run an exchange plan as NCCL may at worst: a batch completes only when every message in it is matched
    by the peer's batch that is posted at the same time. Raise ScheduleError on a deadlock. The plan names each
    message's ranks, so the layout it was made for (``exchange_plan``'s ``shape``) is not needed here."""
    clock = [0.0] * pp
    busy = [0.0] * pp
    live = [0.0] * pp
    peak = [0.0] * pp
    pc = [0] * pp
    matched: dict[Message, float] = {}

    def posted(rank: int) -> Exchange | None:
        return plan[rank][pc[rank]] if pc[rank] < len(plan[rank]) and isinstance(plan[rank][pc[rank]], Exchange) \
            else None

    while any(pc[r] < len(plan[r]) for r in range(pp)):
        progress = False
        for r in range(pp):
            while pc[r] < len(plan[r]):
                action = plan[r][pc[r]]
                if isinstance(action, Op):
                    cost = f_cost if action.kind == F else b_cost
                    clock[r] += cost
                    busy[r] += cost
                    live[r] += f_cost if action.kind == F else -f_cost
                    peak[r] = max(peak[r], live[r])
                    pc[r] += 1
                    progress = True
                    continue
                for msg in (*action.sends, *action.recvs):
                    peer = msg.dst if msg.src == r else msg.src
                    theirs = posted(peer)
                    mirror = theirs is not None and msg in (theirs.recvs if msg.src == r else theirs.sends)
                    if msg not in matched and mirror:
                        matched[msg] = max(clock[r], clock[peer])
                waiting = [m for m in (*action.sends, *action.recvs) if m not in matched]
                if waiting:
                    break
                clock[r] = max([clock[r], *(matched[m] for m in (*action.sends, *action.recvs))])
                pc[r] += 1
                progress = True
        if not progress:
            stuck = [f"rank {r} waits on " + ", ".join(str(m) for m in (*plan[r][pc[r]].sends, *plan[r][pc[r]].recvs)
                                                       if m not in matched)
                     for r in range(pp) if pc[r] < len(plan[r])]
            raise ScheduleError("deadlock in the exchanges: " + "; ".join(stuck))
    steps = [sum(isinstance(a, Op) for a in actions) for actions in plan]
    return Simulation(max(clock), busy, steps, peak)


def compare_with_1f1b(pp: int, num_microbatches: int) -> dict:
    """DualPipeV against 1F1B for one model of ``2 * pp`` equal chunks on ``pp`` ranks: 1F1B gives each rank
    one stage of two chunks (F = 2, B = 4), DualPipeV two chunks (F = 1, B = 2). Times in chunk forwards."""
    v = simulate(dualpipev_order(pp, num_microbatches), pp)
    line = simulate(one_f_one_b_order(pp, num_microbatches), pp, shape="line", f_cost=2 * F_COST,
                    b_cost=2 * B_COST)
    return {
        "pp": pp, "microbatches": num_microbatches, "ideal": 6.0 * num_microbatches,
        "dualpipev_step": v.makespan, "dualpipev_bubble_per_rank": max(v.idle), "dualpipev_bubble": v.bubble,
        "dualpipev_peak_activations": max(v.peak_activations),
        "1f1b_step": line.makespan, "1f1b_bubble_per_rank": max(line.idle), "1f1b_bubble": line.bubble,
        "1f1b_peak_activations": max(line.peak_activations),
    }
