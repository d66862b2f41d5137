"""The megatron engine as an ``Engine`` (``nam_core.engine.contract``): one process per GPU under torchrun (one GPU:
this process, ``parallel.one_rank_env``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from nam_core.engine.contract import EngineRun, Ranks
from nam_core.engine.megatron import checkpoint, checks, loop, optimizer, parallel


class MegatronEngine:
    name = "megatron"

    def start(self, spec, *, dry_run: bool, relaunch: Callable[[int], None] | None = None) -> Ranks:
        """Before anything touches CUDA: the allocator, the runtime, then the process group. With ``--nproc N``
        and no torchrun around this process, ``relaunch(N)`` replaces it with torchrun running the same
        command (and does not return); ``--nproc 1`` trains in this process as torchrun's one worker would
        (``parallel.one_rank_env``). A dry run starts nothing: the ranks it would have."""
        lay = spec.layout
        if dry_run:
            return Ranks(0, lay.world_size)
        if "WORLD_SIZE" not in os.environ and lay.nproc is not None and relaunch is not None:
            if lay.nproc == 1:
                parallel.one_rank_env(os.environ)
            else:
                relaunch(lay.nproc)
        import torch

        checks.prepare_allocator(os.environ, cuda_initialized=torch.cuda.is_initialized(),
                                 async_saves=spec.train.async_checkpoints
                                 and spec.train.checkpoint_every > 0)
        checks.check_runtime(checks.runtime_facts(), dispatcher=spec.train.moe_dispatcher,
                             precision_aware=optimizer.precision_aware(spec.train))
        parallel.init_distributed()
        return Ranks(torch.distributed.get_rank(), lay.world_size)

    def good_checkpoints(self, ckpt_root: Path) -> list[Path]:
        """Collective across ranks once the process group is up (rank 0 hashes, every rank decides on its
        digests: ``checkpoint.good_checkpoints_shared``)."""
        import torch

        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            return checkpoint.good_checkpoints_shared(ckpt_root)
        return checkpoint.good_checkpoints(ckpt_root)

    def check_ahead(self, ckpt_root: Path) -> None:
        checkpoint.check_ahead(ckpt_root)

    def resolve_resume(self, spec: str, ckpt_root: Path, *, warn: Callable[[str], None]) -> Path:
        return checkpoint.resolve_resume(spec, ckpt_root, warn=warn)

    def barrier(self) -> None:
        import torch

        torch.distributed.barrier()

    def train(self, run: EngineRun) -> dict:
        return loop.train(run)

    def finish(self) -> None:
        """After success only: after an error on one rank, the others may sit in a collective (torchrun then
        stops them), and a barrier here would wait for them forever."""
        parallel.shutdown()
