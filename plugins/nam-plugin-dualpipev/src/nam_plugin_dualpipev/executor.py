"""Run one rank's part of a DualPipeV step on real modules, with torch.distributed point-to-point.

The rank walks its list from ``schedule.exchange_plan``: ops (the forward or backward of one chunk for one
micro-batch) and, between them, batches of sends and receives run through ``batch_isend_irecv`` and waited
for whole. That list is the whole protocol; see ``exchange_plan`` for why it cannot mix messages up or
deadlock on gloo or NCCL. In short:

* every message has one fixed shape and dtype (the activation's, ``shape`` / ``dtype``): a forward's output
  and the gradient of a stage's input are the same tensor shape, so a receive buffer is made before the
  message arrives, and a stage whose output has another shape is refused;
* on each link, sender and receiver order the messages the same way (NCCL matches by order, not by tag);
  a message that arrives before its op waits in the rank's inbox;
* both sides of a message sit in the batch of the same *moment* of the plan, and every rank runs its
  batches in the order of their moments.

Compute and communication do not overlap, and each backward runs whole: DualPipe's overlapped F&B pairs
and zero-bubble weight-gradient split are not done here (README, "Not done").
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from nam_core.errors import NamError
from nam_plugin_dualpipev.schedule import (
    Action,
    B,
    Exchange,
    F,
    Layout,
    Message,
    Op,
    dualpipev_order,
    exchange_plan,
    forward_only,
)

Forward = Callable[[int, int, "torch.Tensor | None"], torch.Tensor]
"""``(chunk, micro-batch, input)`` -> the chunk's output. ``input`` is None on the first stage (rank 0, chunk
0), which reads the micro-batch itself; elsewhere it is the previous stage's output, ``[shape]``."""
Loss = Callable[[int, torch.Tensor], torch.Tensor]
"""``(micro-batch, last stage's output)`` -> the scalar the backward starts from (rank 0, chunk 1)."""


def device_of(module: nn.Module) -> torch.device:
    """Where the module's parameters live (receive buffers are made there); the CPU if it has none."""
    first = next(iter(module.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


@functools.lru_cache(maxsize=32)
def plan_for(pp: int, num_microbatches: int, train: bool = True) -> tuple[tuple[Action, ...], ...]:
    """The exchange plan of every rank for one step (cached: it depends on the sizes only)."""
    order = dualpipev_order(pp, num_microbatches)
    if not train:
        order = forward_only(order)
    return tuple(tuple(actions) for actions in exchange_plan(order, pp))


class PipelineRank:
    """One rank's state during one step: what arrived, what waits to be sent, what each backward needs."""

    def __init__(self, *, pp: int, rank: int, forward: Forward, loss: Loss, shape: Sequence[int],
                 dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup | None = None):
        self.layout = Layout(pp)
        self.rank = rank
        self.forward, self.loss = forward, loss
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.group = group
        self.inbox: dict[Message, torch.Tensor] = {}
        self.outbox: dict[Message, torch.Tensor] = {}
        self.saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        """(chunk, micro-batch) -> (the stage's input leaf, its output or loss): what its backward needs."""
        self.losses: dict[int, torch.Tensor] = {}

    def run(self, actions: Sequence[Action], *, train: bool = True) -> dict[int, torch.Tensor]:
        """Run ``actions`` in order; return the detached loss of each micro-batch (rank 0 only, else {})."""
        for action in actions:
            if isinstance(action, Exchange):
                self._exchange(action)
            elif action.kind == F:
                self._forward(action.chunk, action.microbatch, train)
            else:
                self._backward(action.chunk, action.microbatch)
        left = [str(m) for m in (*self.inbox, *self.outbox)] + [f"chunk {c} mb {i}" for c, i in self.saved]
        if left:
            raise NamError(f"rank {self.rank} ended the step with unused messages or activations: {left[:4]}",
                           hint="the plan does not match the order; rebuild it with schedule.exchange_plan")
        return self.losses

    # --- compute ------------------------------------------------------------------------------------------

    def _forward(self, chunk: int, microbatch: int, train: bool) -> None:
        op = Op(F, chunk, microbatch)
        x = None
        need = self.layout.needs(self.rank, op)
        if need is not None:
            x = self.inbox.pop(need)
            if train:
                x = x.detach().requires_grad_()  # a leaf of this chunk's graph: its .grad goes back upstream
        with torch.set_grad_enabled(train):
            y = self.forward(chunk, microbatch, x)
            out = self.layout.produces(self.rank, op)
            if out is None:  # the last stage: the loss, not a message
                y = self.loss(microbatch, y)
                self.losses[microbatch] = y.detach()
            else:
                self._check(y, out)
                (self.inbox if out.dst == self.rank else self.outbox)[out] = y  # the V's turn stays local
        if train:
            self.saved[chunk, microbatch] = (x, y)

    def _backward(self, chunk: int, microbatch: int) -> None:
        op = Op(B, chunk, microbatch)
        x, y = self.saved.pop((chunk, microbatch))
        need = self.layout.needs(self.rank, op)
        if need is None:
            y.backward()  # the loss
        else:
            torch.autograd.backward(y, self.inbox.pop(need))
        out = self.layout.produces(self.rank, op)
        if out is None:
            return  # the first stage: nothing upstream
        if x.grad is None:
            raise NamError(f"stage {out.stage} (rank {self.rank}, chunk {chunk}) produced no gradient for its input; "
                           "every stage after the first must use its input",
                           hint="check that the chunk's forward uses the tensor it is given")
        (self.inbox if out.dst == self.rank else self.outbox)[out] = x.grad

    def _check(self, y: torch.Tensor, msg: Message) -> None:
        if tuple(y.shape) != self.shape or y.dtype != self.dtype:
            raise NamError(
                f"stage {msg.stage} (rank {self.rank}) returned {tuple(y.shape)} {y.dtype}; dualpipev sends every "
                f"activation with the one fixed shape and dtype it was given, {self.shape} {self.dtype}",
                hint="pass the shape and dtype of the tensor the stages hand on (Megatron: [s, b, h])")

    # --- communication ------------------------------------------------------------------------------------

    def _peer(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _exchange(self, batch: Exchange) -> None:
        ops, arriving = [], []
        for msg in batch.sends:
            ops.append(dist.P2POp(dist.isend, self.outbox.pop(msg).detach().contiguous(), self._peer(msg.dst),
                                  self.group))
        for msg in batch.recvs:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buffer, self._peer(msg.src), self.group))
            arriving.append((msg, buffer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.inbox.update(arriving)


def run_dualpipev(
    chunks: Sequence[nn.Module],
    *,
    inputs: Sequence[torch.Tensor] | None,
    loss_fn: Callable[[torch.Tensor, int], torch.Tensor],
    num_microbatches: int,
    shape: Sequence[int],
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    train: bool = True,
    plan: Sequence[Sequence[Action]] | None = None,
) -> list[torch.Tensor]:
    """One DualPipeV step of this rank's two chunks; return the micro-batch losses on rank 0 ([] elsewhere).

    ``chunks``: (stage r, stage 2P-1-r) of this pipeline rank r. ``inputs``: the micro-batches, read by rank
    0's chunk 0 (other ranks may pass None). ``loss_fn(output, index)``: the loss of micro-batch ``index``
    from rank 0's chunk 1. ``shape``/``dtype``: of every tensor a stage hands on. With ``train`` the
    gradients of all micro-batches accumulate in the parameters' ``.grad`` (the backward of the sum of the
    losses). ``plan``: the exchange plan of every rank; by default the one for these sizes (tests pass a
    broken one to show the comparison catches it).
    """
    if len(chunks) != 2:
        raise NamError(f"dualpipev runs two model chunks per pipeline rank (stage r and stage 2P-1-r), "
                       f"found {len(chunks)}", hint="split the model into 2 x pp stages and pass this rank's pair")
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank == 0 and (inputs is None or len(inputs) != num_microbatches):
        found = "none" if inputs is None else len(inputs)
        raise NamError(f"rank 0 reads the micro-batches: expected {num_microbatches} inputs, found {found}",
                       hint="pass inputs=[one tensor per micro-batch] on rank 0")
    device = device or device_of(chunks[0])
    actions = (plan or plan_for(pp, num_microbatches, train))[rank]

    def forward(chunk: int, microbatch: int, x: torch.Tensor | None) -> torch.Tensor:
        return chunks[chunk](inputs[microbatch] if x is None else x)

    losses = PipelineRank(pp=pp, rank=rank, forward=forward, loss=lambda i, y: loss_fn(y, i), shape=shape,
                          dtype=dtype, device=device, group=group).run(actions, train=train)
    return [losses[i] for i in range(num_microbatches)] if rank == 0 else []
