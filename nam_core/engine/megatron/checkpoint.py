"""dist-checkpointing save and resume of the model chunks, the distributed optimizer and every rank's RNG:
atomic (written aside, renamed into place after the manifest), resumable only with the same layout."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from nam_core.engine import checkpoint as files
from nam_core.engine.megatron.model import unwrap
from nam_core.errors import NamError

CHECKPOINT_FORMAT = "megatron-dist-1"


def _model_state(models: list) -> dict:
    """The chunks' sharded state dicts: one chunk's as is, several under ``model0``, ``model1``, ... as
    Megatron's own checkpoints keep virtual-pipeline chunks. Unwrapped: no DDP "module." prefixes (§9.3)."""
    states = [unwrap(m).sharded_state_dict() for m in models]
    return states[0] if len(states) == 1 else {f"model{i}": state for i, state in enumerate(states)}


def _sharded_state(models: list, optimizer, *, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_sd = _model_state(models)
    # dp_reshardable: each rank writes its own optimizer shards (resume needs the same layout, which
    # load_checkpoint enforces). 0.19.2's default, fully_sharded_model_space, raises "ShardedTensor.flattened_range
    # is not supported" (dist_checkpointing/mapping.py:134).
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata),
            "rng": ShardedObject("rng", files.rng_state(), (world,), (rank,), replica_id=0)}


def good_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete megatron-engine checkpoints under ``ckpt_root``, oldest first (a manifest is written last)."""
    if not ckpt_root.is_dir():
        return []
    good = []
    for folder in sorted(p for p in ckpt_root.glob("step-*") if p.is_dir()):
        manifest = folder / "manifest.json"
        if manifest.is_file() and json.loads(manifest.read_text()).get("format") == CHECKPOINT_FORMAT:
            good.append(folder)
    return good


def save_checkpoint(ckpt_root: Path, step: int, models: list, optimizer, *, manifest: dict, keep: int) -> Path:
    """Collective: every rank writes its shards into a hidden folder, rank 0 adds the manifest and renames
    it into place (atomic on POSIX), then prunes old checkpoints. A crash leaves the last good one intact."""
    from megatron.core import dist_checkpointing

    rank0 = torch.distributed.get_rank() == 0
    final = ckpt_root / f"step-{step:08d}"
    tmp = ckpt_root / f".{final.name}.tmp"
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded_state(models, optimizer, is_loading=False), str(tmp), verify_integrity=True)
    torch.distributed.barrier()
    if rank0:
        (tmp / "manifest.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step, **manifest},
                                                      indent=2))
        for path in tmp.iterdir():  # on disk before the rename makes the folder count as good
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        files.fsync_dir(tmp)
        if final.exists():  # the same step saved again (end of a resumed run)
            shutil.rmtree(final)
        os.rename(tmp, final)
        files.fsync_dir(ckpt_root)
        for old in good_checkpoints(ckpt_root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    torch.distributed.barrier()
    return final


def resolve_resume(spec: str, ckpt_root: Path) -> Path:
    """``auto`` -> the newest good megatron-engine checkpoint under ``ckpt_root``; a path -> that folder, if
    it is one (the layout is checked when it loads)."""
    return files.resolve_resume(
        spec, ckpt_root, good=good_checkpoints, what="megatron-engine checkpoint",
        is_good=lambda folder: folder.resolve() in [g.resolve() for g in good_checkpoints(folder.parent)],
        why_not=f"no {CHECKPOINT_FORMAT} manifest")


def load_checkpoint(folder: Path, models: list, optimizer, *, layout: dict) -> dict:
    """Restore the model chunks, optimizer and per-rank RNG from ``folder``; refuse another parallel layout.
    Needs the engine's patch lane in force (torch AdamW's state before a load and its steps after one)."""
    from megatron.core import dist_checkpointing

    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise NamError(f"{folder} is not a complete megatron-engine checkpoint (no {CHECKPOINT_FORMAT} manifest)",
                       hint="resume from a folder listed by good_checkpoints, or start without --resume")
    if manifest.get("layout") != layout:
        raise NamError(f"{folder} was written with layout {manifest.get('layout')}, this run is {layout}",
                       hint="resume with the same GPUs, tp, pp and ep")
    state = dist_checkpointing.load(_sharded_state(models, optimizer, is_loading=True), str(folder),
                                    verify_integrity=True)
    with torch.no_grad():  # the optimizer copies into its main params, leaves that require grad
        for i, model in enumerate(models):
            unwrap(model).load_state_dict(state["model"] if len(models) == 1 else state["model"][f"model{i}"])
        optimizer.load_state_dict(state["optimizer"])
    files.set_rng_state(state["rng"])
    return manifest
