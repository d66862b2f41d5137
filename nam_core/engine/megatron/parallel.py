"""Process groups (TP, PP, EP; the rest is data parallel), seeds and this rank's device."""

from __future__ import annotations

import os
import socket
from typing import MutableMapping

import torch

from nam_core.engine.megatron.schedule import PipelineSchedule


ONE_RANK = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets for each worker and ``init_distributed`` (``env://``) and Megatron read."""


def one_rank_env(env: MutableMapping[str, str]) -> dict[str, str]:
    """Make ``env`` the environment torchrun gives the only worker of ``--nproc-per-node=1``: rank 0 of 1, with a
    rendezvous on a free port of 127.0.0.1 (a port the OS just handed out, as ``torchrun --standalone`` picks its
    own). ``nam train --engine megatron --nproc 1`` trains in its own process this way rather than exec'ing
    torchrun, which would start Python twice more and import everything again for a launcher with nothing to
    launch but this process (the resume's ``resolve`` phase took 8.1-9.4 s that way on an H200, 0.1 s this way:
    bench/README.md). Returns what it set."""
    if "WORLD_SIZE" in env:
        raise RuntimeError(f"one_rank_env under a launcher (WORLD_SIZE={env['WORLD_SIZE']}): the launcher's "
                           "environment stands")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    given = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port))
    env.update(given)
    return given


def init_distributed() -> None:
    """This rank's GPU (from LOCAL_RANK) and the NCCL default group; idempotent. ``nam train`` calls it early
    (rank 0 prepares data and writes the run folder while the others wait)."""
    if torch.distributed.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local_rank))


def init_parallel(*, tp: int, pp: int, ep: int, seed: int, schedule: PipelineSchedule | None = None):
    """NCCL process groups for tp x pp x ep, with the embedding group the schedule's layout needs; Megatron's
    RNG trackers. Returns Megatron's ``ProcessGroupCollection``."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    init_distributed()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        get_embedding_ranks=schedule.embedding_ranks() if schedule is not None else None)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def device() -> torch.device:
    """This rank's GPU (``init_distributed`` selects it from LOCAL_RANK)."""
    return torch.device("cuda", torch.cuda.current_device())


def max_over_ranks(value: int) -> int:
    """The largest ``value`` over every rank: one all-reduce of one integer, on the GPU under NCCL and on the host
    under gloo (the CPU test double). Collective."""
    on = device() if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([value], dtype=torch.int64, device=on)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item())


def shutdown() -> None:
    """Tear the process groups down at the end of a successful run (NCCL warns at exit otherwise). Never on
    an error path: its barrier would wait for ranks that are stuck in a collective."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
