"""dist-checkpointing save and resume of the model chunks, the distributed optimizer and every rank's RNG:
atomic (written aside, renamed into place after the manifest), resumable only with the same layout.

Loading a checkpoint must not run code that came with it (a run folder can come from someone else):

- every rank's RNG state is nam's own file, ``rng/rank-NNNNN.pt``, tensors and plain numbers loaded with
  ``weights_only=True`` (format 1 kept it as a Megatron ``ShardedObject``, which torch's checkpoint planner
  unpickles with ``weights_only=False``);
- what Megatron-Core's loader does not allow us to make safe: torch's ``FileSystemReader.read_metadata``
  reads ``.metadata`` with a bare ``pickle.load``, and ``DefaultLoadPlanner.load_bytes`` unpickles every
  byte item (Megatron's own ``common_state`` object in >= 0.19) with ``weights_only=False``; neither takes an
  argument to restrict it. So ``refuse_unsafe_pickles`` reads both first, under restricted unpicklers that
  rebuild only torch's checkpoint-metadata classes and tensors/plain values, and refuses the folder if
  either asks for more; Megatron then loads the same bytes;
- the manifest lists the sha256 of every file, checked by ``good_checkpoints`` (which protects against
  damage, not against an attacker, who rewrites the manifest too).
"""

from __future__ import annotations

import contextlib
import enum
import io
import json
import math
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from dataclasses import is_dataclass
from pathlib import Path
from typing import Callable

import torch

from nam_core.engine import checkpoint as files
from nam_core.engine.async_checkpoint import registered_buffers
from nam_core.engine.megatron import parallel
from nam_core.engine.megatron.model import unwrap
from nam_core.errors import NamError, RunFolderError

CHECKPOINT_FORMAT = "megatron-dist-2"  # 2: RNG in rng/*.pt (tensors only), sha256 of every file (1: neither)


def _model_state(models: list) -> dict:
    """The chunks' sharded state dicts: one chunk's as is, several under ``model0``, ``model1``, ... as
    Megatron's own checkpoints keep virtual-pipeline chunks. Unwrapped: no DDP "module." prefixes (§9.3)."""
    states = [unwrap(m).sharded_state_dict() for m in models]
    return states[0] if len(states) == 1 else {f"model{i}": state for i, state in enumerate(states)}


def _sharded_state(models: list, optimizer, *, is_loading: bool) -> dict:
    model_sd = _model_state(models)
    # dp_reshardable: each rank writes its own optimizer shards (resume needs the same layout, which
    # load_checkpoint enforces). 0.19.2's default, fully_sharded_model_space, raises "ShardedTensor.flattened_range
    # is not supported" (dist_checkpointing/mapping.py:134).
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}


def _rng_file(folder: Path, rank: int) -> Path:
    return folder / "rng" / f"rank-{rank:05d}.pt"


OPTIMIZER_MAP = "optimizer-map"
"""``optimizer-map/rank-NNNNN.json``: where each rank's distributed-optimizer shards sit, for reading a
checkpoint's optimizer state back per parameter without Megatron (``optimizer_tensors``: ``nam export
--with-optimizer``). Megatron's ``dp_reshardable`` state keeps each bucket of parameters as one flat tensor per
state (``param``, ``exp_avg``, ``exp_avg_sq``) and does not record which range is which parameter."""


def _write_optimizer_map(tmp: Path, state: dict, optimizer, rank: int) -> None:
    """This rank's part of the optimizer map (``OPTIMIZER_MAP``), from the sharded state about to be saved: for
    every parameter range this rank's optimizer owns, the flat bucket tensor it sits in (``bucket``: the key
    without ``.exp_avg``), where (``at``) and how long (``numel``), and the model tensor it belongs to (``param``:
    its checkpoint key, ``offset`` and ``prepend`` its place in the global tensor, ``shape`` this rank's local
    shape, ``start`` the range's first element in it). ``steps``: Adam's step counts on this rank, where the inner
    optimizer keeps them (``optimizer.inner_adam``: each parameter's state with torch's AdamW, each parameter
    group with Transformer Engine's FusedAdam). A range whose shards the sharded state does not hold as plain
    tensors, and Megatron's precision-aware optimizer (FusedAdam's masters as remainders), make the map
    ``{"complete": false, "why": ...}``, which the export reports."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from nam_core.engine.megatron.optimizer import group_steps, inner_adam, precision_aware_refusal

    def index(tree, kinds=(ShardedTensor,)) -> dict:
        return {(t.data.data_ptr(), t.data.numel(), t.data.dtype): t for t in nested_values(tree)
                if isinstance(t, kinds)}

    # a factory (Megatron's gated MLP weights) is read back whole only: "offset" None, checked when read
    model, moments = index(state["model"], (ShardedTensor, ShardedTensorFactory)), index(state["optimizer"])
    entries, steps, why, hint = [], set(), None, None
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(getattr(inner, "config", None), "use_precision_aware_optimizer", False):
            why = precision_aware_refusal()
            hint = (f"export its weights alone (nam export {tmp.parent}/{tmp.name.lstrip('.').removesuffix('.tmp')} "
                    "--out DIR), or train with --set train.fused_master_weights=false --set "
                    "train.optimizer_numerics=fp32-master to carry the optimizer")
            continue
        if inner_adam(getattr(inner, "optimizer", None)) == "te-fused":
            steps |= group_steps(inner.optimizer)
        for param in getattr(inner, "model_param_group_index_map", {}):
            states = inner._get_main_param_and_optimizer_states(param)
            if "exp_avg" not in states:
                why = "Adam has no state yet (a checkpoint before the first step)"
                continue
            span = inner._get_model_param_range_map(param)["param"]
            held = moments.get((states["exp_avg"].data_ptr(), states["exp_avg"].numel(), states["exp_avg"].dtype))
            owner = model.get((param.data_ptr(), param.numel(), param.dtype))
            factory = isinstance(owner, ShardedTensorFactory)
            if held is None or owner is None or (not factory and tuple(owner.local_shape) != tuple(param.shape)):
                why = f"a parameter of shape {tuple(param.shape)} has no plain sharded tensor in the checkpoint"
                continue
            if "step" in states:  # torch's AdamW
                steps.add(float(states["step"]))
            entries.append({"bucket": held.key.rpartition(".")[0], "at": int(held.global_offset[0]),
                            "numel": int(span.end - span.start), "param": owner.key, "start": int(span.start),
                            "shape": list(param.shape),
                            "offset": None if factory else [int(o) for o in owner.global_offset],
                            "prepend": 0 if factory else int(owner.prepend_axis_num)})
    body = {"complete": why is None, "why": why, "steps": sorted(steps), "entries": entries}
    if hint is not None:
        body["hint"] = hint
    path = tmp / OPTIMIZER_MAP / f"rank-{rank:05d}.json"
    path.parent.mkdir(exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(body))
        f.flush()
        os.fsync(f.fileno())


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder`` but the manifest, by path relative to it."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p != folder / "manifest.json"]
    return {str(p.relative_to(folder)): digest for p, digest in files.hash_files(paths).items()}


def inspect(folder: Path) -> tuple[dict | None, str]:
    """``(manifest, "")`` for a good megatron-engine checkpoint folder, ``(None, what is wrong)`` otherwise:
    a manifest of this format, and exactly the files it lists, each with its sha256."""
    manifest, why = files.read_manifest(folder)
    if why:
        return None, why
    if not isinstance(manifest, dict) or manifest.get("format") != CHECKPOINT_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        return None, f"no {CHECKPOINT_FORMAT} manifest (format {found!r})"
    listed = manifest.get("sha256")
    if not isinstance(listed, dict) or ".metadata" not in listed:
        return None, "the manifest lists no .metadata (not a dist-checkpointing save)"
    on_disk = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {"manifest.json"}
    if on_disk != set(listed):
        missing, extra = sorted(set(listed) - on_disk), sorted(on_disk - set(listed))
        return None, f"files differ from the manifest (missing {missing[:3]}, not listed {extra[:3]})"
    key = _verified_key(folder, listed)
    if key in _VERIFIED:
        return manifest, ""
    found = files.hash_files([folder / name for name in listed])  # side by side (a file per writer thread)
    for name, digest in listed.items():
        if found[folder / name] != digest:
            return None, f"sha256 mismatch of {name} (the file changed after it was saved)"
    _VERIFIED.add(key)
    return manifest, ""


_VERIFIED: set = set()
"""Folders this process has hashed and found good, keyed by every file's digest and stat (size, mtime, ctime,
inode): a NAM56R checkpoint is ~66 GB, and discovery, pruning and the load would otherwise each hash it again.
A write to any file moves its mtime and ctime, so a changed file is hashed again."""


def _verified_key(folder: Path, digests: dict) -> tuple:
    stats = []
    for name in sorted(digests):
        st = (folder / name).stat()
        stats.append((name, digests[name], st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    return (str(folder.resolve()), tuple(stats))


def good_checkpoints(ckpt_root: Path) -> list[Path]:
    """Good megatron-engine checkpoints under ``ckpt_root`` (``inspect``), oldest first."""
    if not ckpt_root.is_dir():
        return []
    return [p for p in sorted(ckpt_root.glob("step-*")) if p.is_dir() and inspect(p)[0] is not None]


def good_checkpoints_shared(ckpt_root: Path) -> list[Path]:
    """``good_checkpoints`` with the hashing done once for all ranks. Collective: rank 0 checks (hashing every
    listed file, or reading what its ``check_ahead`` hashed), then hands every rank its digests
    (``files.known_digests``, one object broadcast), and each rank's own check reads them from its cache
    (``files.adopt_digests``), so every rank decides for itself on the same bytes. Without it each of a node's 8
    ranks read and hashed the whole checkpoint (~53 GB at NAM56R's size) at every start."""
    box, rank0 = [None], torch.distributed.get_rank() == 0
    if rank0:
        good = good_checkpoints(ckpt_root)
        box[0] = files.known_digests(p for p in ckpt_root.glob("step-*/**/*") if p.is_file()) \
            if ckpt_root.is_dir() else {}
    torch.distributed.broadcast_object_list(box, src=0)
    if rank0:
        return good
    files.adopt_digests(box[0])
    return good_checkpoints(ckpt_root)


def check_ahead(ckpt_root: Path) -> None:
    """This rank's part of a start's checkpoint check, begun early on a background thread (``VerifyAhead``):
    rank 0 hashes; the others wait for its digests in ``good_checkpoints_shared``. Not collective."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        good_checkpoints(ckpt_root)


def save_checkpoint(ckpt_root: Path, step: int, models: list, optimizer, *, manifest: dict, keep: int) -> Path:
    """Collective: every rank writes its shards into a hidden folder, rank 0 adds the manifest and renames
    it into place (atomic on POSIX), then prunes old checkpoints. A crash leaves the last good one intact; a
    full disk is RunFolderError (exit 6) on the ranks that met it, the hidden folder removed."""
    rank = torch.distributed.get_rank()
    rank0 = rank == 0
    final = ckpt_root / f"step-{step:08d}"
    tmp = ckpt_root / f".{final.name}.tmp"
    need = save_bytes(ckpt_root)
    check_space(ckpt_root, need)
    try:
        _save_aside(tmp, models, optimizer, rank)
        if rank0:
            _finish(tmp, final, ckpt_root, step, manifest, keep)
    except BaseException as exc:
        _save_failed(ckpt_root, tmp, exc, need)
    torch.distributed.barrier()
    return final


def _save_failed(ckpt_root: Path, tmp: Path, exc: BaseException, need: int | None = None):
    """A save's error, raised again once rank 0 removed the hidden folder: a full disk as ``files.no_space``
    (exit 6, what one checkpoint needs), anything else as it is. A full disk is ENOSPC in the error's chain, or,
    when the error came from Megatron's forked writer (which hands back only "results_queue should not be
    empty"), less free space than the save needs (``need`` bytes) once its folder is gone."""
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if files.rundir.disk_full(exc) or _short_of_space(ckpt_root, need):
        need = need if need is not None else save_bytes(ckpt_root)
        raise files.no_space(ckpt_root, need / 2**20 if need is not None else None,
                             good_checkpoints(ckpt_root)) from exc
    raise exc


def save_bytes(ckpt_root: Path, host: HostShards | None = None) -> int | None:
    """About what the next save writes: the newest finished checkpoint's files (a ``step-*`` folder with its
    manifest; not hashed again), else the host buffers' bytes (``host``), else None."""
    done = sorted(p for p in ckpt_root.glob("step-*") if (p / "manifest.json").is_file()) if ckpt_root.is_dir() else []
    if done:
        return sum(p.stat().st_size for p in done[-1].rglob("*") if p.is_file())
    return host.record.nbytes if host is not None else None


def _short_of_space(ckpt_root: Path, need: int | None) -> bool:
    """Less free space under ``ckpt_root`` than ``need`` bytes (False when either is unknown)."""
    free = files.rundir.free_mb(ckpt_root)
    return need is not None and free is not None and free * 2**20 < need


def check_space(ckpt_root: Path, need: int | None) -> None:
    """Refuse a save that cannot fit (``files.no_space``, exit 6, nothing written): less free space under
    ``ckpt_root`` than ``need`` bytes. The finished checkpoints stay until the new one is complete, so at
    ``train.keep_checkpoints=1`` a disk holds two. Round 11 (one H200, a 64 GiB disk, 2 x ~53 GB): the second
    save of a run filled the disk in Megatron's forked writer, and the error that came back named no disk.
    Collective: every rank refuses when any rank's disk is short (the save is collective too)."""
    if parallel.max_over_ranks(int(_short_of_space(ckpt_root, need))):
        raise files.no_space(ckpt_root, need / 2**20 if need is not None else None, good_checkpoints(ckpt_root),
                             started=False)


def _aside(tmp: Path, rank: int) -> None:
    """Collective: the hidden folder ``tmp`` made afresh by rank 0, then this rank's RNG state in it."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    torch.distributed.barrier()
    files._save_file(files.rng_state(), _rng_file(tmp, rank))


def writer_threads() -> int:
    """Files each rank writes side by side (Megatron's ``thread_count``): this host's cores shared by its ranks
    (``LOCAL_WORLD_SIZE``, set by torchrun), at most 8 (async_checkpoint.FILES: enough for one disk)."""
    from nam_core.engine.async_checkpoint import FILES

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(FILES, (os.cpu_count() or 1) // max(1, local)))


class BackgroundSaves:
    """The megatron engine's checkpoints written in the background (``train.async_checkpoints``): Megatron's
    ``dist_checkpointing.save`` with ``async_sharded_save`` (its ``mcore`` writer: a forked process writes each
    rank's shards from host memory) and Megatron's ``AsyncCallsQueue``, whose finalization runs on every rank once
    every rank's writer is done (an all-reduce per ``poll``) and writes Megatron's metadata. Then rank 0 fsyncs,
    hashes every file into nam's manifest and renames the folder into place (``_finish``, as ``save_checkpoint``
    does) on a thread of its own: hashing a NAM56R checkpoint takes tens of seconds. Megatron's own integrity.json
    (a second hash of every file on the training thread) is not written: nam's manifest holds the same digests and
    ``inspect`` checks them before a load. One save at a time: ``save`` waits for the one before it. Every method
    is collective.

    Host buffers: every shard the save writes is first copied into a host buffer of this object's
    (``HostShards``), page-locked on CUDA, and the sharded state handed to Megatron holds those buffers, so
    Megatron's own copy to the host (``FileSystemWriterAsync.preload_tensors``: ``tensor.to("cpu",
    non_blocking=True)``) finds them there and copies nothing. The buffers are made once per process, on a
    background thread, from the first step's sharded state (``prepare``, after the first optimizer step), and kept
    between saves. Without them Megatron's copy allocated page-locked memory from torch's caching host allocator
    on the training thread at the first save (one ``cudaHostAlloc`` per shard): 41.2 s of training stalled for the
    53 GB checkpoint of full NAM56R (one H200, 2026-11-28).

    What the training thread pays per save (Megatron-Core 0.19.2, ``mcore`` async): the sharded state dict and
    the save plan, the copy into the host buffers, and the fork of the writer process. One save strategy is kept
    for the run, as Megatron's ``--ckpt-assume-constant-structure`` keeps it: its save plans are cached after the
    first save (``use_cached_ckpt_structure``) and the sharding is validated on the first save only;
    ``writer_threads()`` files per rank are written side by side (``thread_count``, Megatron's
    ``--dist-ckpt-workers``) and hashed side by side."""

    def __init__(self, ckpt_root: Path, *, keep: int, note):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        self.ckpt_root, self.keep, self.note = ckpt_root, keep, note
        self.queue = AsyncCallsQueue()
        self.strategy = TorchDistSaveShardedStrategy(thread_count=writer_threads())
        self.strategy.use_cached_ckpt_structure = True  # nam's state keeps its structure from save to save
        self.saved_once = False
        self.host: HostShards | None = None
        self.pending: dict | None = None  # final, tmp, stall_s, started; "written" once Megatron finalized
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_good: Path | None = None

    def save(self, step: int, models: list, optimizer, *, manifest: dict) -> None:
        """Start writing checkpoint ``step``; training goes on once the shards are in host memory."""
        from megatron.core import dist_checkpointing

        t0, previous = time.perf_counter(), self.pending
        self.wait()
        if previous is not None:  # training stood still until the previous write ended: part of this save's cost
            self.note(f"checkpoint {self.ckpt_root / f'step-{step:08d}'}: training waited {time.perf_counter() - t0:.1f} s for the previous "
                      "checkpoint's background write (train.checkpoint_every steps took less than a write)")
        t0 = time.perf_counter()
        rank = torch.distributed.get_rank()
        final = self.ckpt_root / f"step-{step:08d}"
        tmp = self.ckpt_root / f".{final.name}.tmp"
        parts = {}
        need = save_bytes(self.ckpt_root, self.host)
        check_space(self.ckpt_root, need)
        try:
            _aside(tmp, rank)  # the RNG files are small: written here, and so are the optimizer maps
            state = _sharded_state(models, optimizer, is_loading=False)
            _write_optimizer_map(tmp, state, optimizer, rank)
            parts["state"] = time.perf_counter() - t0
            host = self.prepare(models, optimizer, state=state)
            first = not host.taken
            copied = host.copy_in(state)
            parts["copy to host memory"] = copied
            if first:
                r = host.record
                built = "".join(f", {name} in {t:.1f} s" for name, t in host.parts.items())
                self.note(f"checkpoint {final}: its host buffers ({r.nbytes / 1e9:.1f} GB, {r.how}) took "
                          f"{r.built_s:.1f} s to build on a background thread; the save waited {r.waited_s:.1f} s "
                          f"for them (part of its pause){built}")
            t1 = time.perf_counter()
            request = dist_checkpointing.save(state, str(tmp), self.strategy, async_sharded_save=True,
                                              async_strategy="mcore", validate_access_integrity=not self.saved_once)
            self.saved_once = True
            request.add_finalize_fn(lambda: self._written(tmp, final, step, manifest))
            t2 = time.perf_counter()
            parts["plan"] = t2 - t1
            self.queue.schedule_async_request(request)  # forks the writer process
            parts["fork"] = time.perf_counter() - t2
        except BaseException as exc:
            _save_failed(self.ckpt_root, tmp, exc, need)
        self.pending = {"final": final, "tmp": tmp, "stall_s": time.perf_counter() - t0, "started": t0,
                        "written": False, "parts": parts, "need": need}

    def prepare(self, models: list, optimizer, *, state: dict | None = None) -> HostShards:
        """Start building this process's host buffers on a background thread, sized from the sharded state the
        next save will hand Megatron (``state``, or one made now); returns at once. Once per object: later calls
        return the first build. Collective when it makes the state (the sharded state dict)."""
        if self.host is None:
            if state is None:
                state = _sharded_state(models, optimizer, is_loading=False)
            self.host = HostShards(state, pinned=torch.cuda.is_available() and _on_cuda(state))
            if self.pending is None and not self.saved_once:
                self.note(f"checkpoint host buffers: building {self.host.record.nbytes / 1e9:.1f} GB "
                          f"({self.host.record.how}) on a background thread")
        return self.host

    def _written(self, tmp: Path, final: Path, step: int, manifest: dict) -> None:
        """Megatron's finalization is done on every rank: rank 0 starts the manifest and the rename."""
        if torch.distributed.get_rank() != 0:
            return

        def finish():
            try:
                _finish(tmp, final, self.ckpt_root, step, manifest, self.keep)
            except BaseException as exc:  # raised on the training thread by the next poll
                self.error = exc

        self.thread = threading.Thread(target=finish, name=f"nam-manifest-{final.name}")
        self.thread.start()

    def poll(self, *, wait: bool = False) -> Path | None:
        """Move the save in flight on (``wait``: to its end); the newest checkpoint this object finished, or None
        while one is still being written."""
        if self.pending is None:
            return self.last_good
        p = self.pending
        if not p["written"]:
            try:
                p["written"] = bool(self.queue.maybe_finalize_async_calls(blocking=wait))
            except BaseException as exc:
                self.pending = None
                _save_failed(self.ckpt_root, p["tmp"], exc, p["need"])
            if not p["written"]:
                return None
        if self.thread is not None:
            if wait:
                self.thread.join()
            if self.thread.is_alive():
                return None
            self.thread = None
            if self.error is not None:
                error, self.error, self.pending = self.error, None, None
                _save_failed(self.ckpt_root, p["tmp"], error, p["need"])
            parts = ", ".join(f"{name} {t:.1f} s" for name, t in p["parts"].items())
            self.note(f"checkpoint {p['final']}: training paused {p['stall_s']:.1f} s ({parts}), "
                      f"written in {time.perf_counter() - p['started']:.1f} s in the background")
        self.pending, self.last_good = None, p["final"]
        return self.last_good

    def wait(self) -> Path | None:
        """The save in flight finished everywhere (rank 0's manifest and rename too: the barrier), at points every
        rank reaches together (a new save, a stop, the end)."""
        last = self.poll(wait=True)
        torch.distributed.barrier()
        return last

def _shards(state: dict) -> list:
    """The sharded state's tensors as Megatron's save will write them, in a fixed order (depth first): its
    ``ShardedTensor`` objects, once every ``ShardedTensorFactory`` in ``state`` is applied (in place: the save
    would apply them itself)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(state)
    return [v for v in nested_values(state) if isinstance(v, ShardedTensor)]


def _on_cuda(state: dict) -> bool:
    return any(sh.data.is_cuda for sh in _shards(state))


class HostShards:
    """One process's host buffers for the megatron engine's saves: one per shard of the sharded state (its shape
    and dtype), made on a background thread from the shapes alone (the state's tensors are not kept: some are made
    for the save and free their device memory once it is dropped). ``copy_in`` copies a save's shards into them
    and points the shards at them.

    Page-locked (``pinned``, on CUDA) in a way that leaves training alone while they are made: one shared
    anonymous mapping, its pages faulted in by touching them (no CUDA call), then each shard's pages registered
    with CUDA (``cudaHostRegister``, one call per shard). Shared, because Megatron's writer is a forked process,
    and Linux copies a private mapping's DMA-pinned pages into a child at fork. Made with ``cudaHostAlloc``
    instead (torch's pinned allocator, ``torch.empty(..., pin_memory=True)``) the build stopped training for all
    of its 42.5 s: step 2 of full NAM56R took 42.9 s (one H200, round 9, 2026-11-28)."""

    def __init__(self, state: dict, *, pinned: bool):
        from nam_core.engine.async_checkpoint import HostBuffers

        specs = [(tuple(sh.data.shape), sh.data.dtype) for sh in _shards(state)]
        self.specs = specs
        self.record = HostBuffers(sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs),
                                  "register" if pinned else "pageable")
        self.taken = False  # True once a save copied into them (record.waited_s is that save's wait)
        self.pinned = pinned
        self.parts: dict[str, float] = {}  # the build's own steps: pages touched, registered
        self.buffers: list[torch.Tensor] | None = None
        self._built = threading.Event()
        self._error: BaseException | None = None
        device = torch.cuda.current_device() if pinned else None  # the training thread's, for the registration
        threading.Thread(target=self._build, args=(device,), name="nam-host-shards", daemon=True).start()

    def _build(self, device: int | None) -> None:
        t0 = time.perf_counter()
        try:
            if device is not None:
                torch.cuda.set_device(device)
            if not self.pinned:
                self.buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in self.specs]
            else:
                self.buffers = self._registered()
            self.record.built_s = time.perf_counter() - t0
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by copy_in
            self._error = exc
        finally:
            self._built.set()

    def _registered(self) -> list[torch.Tensor]:
        buffers, self.parts = registered_buffers(self.specs)
        return buffers

    def copy_in(self, state: dict) -> float:
        """Copy every shard of ``state`` into its host buffer (waiting for the build the first time) and make the
        shard hold the buffer; the seconds the copy took (the wait apart: ``record.waited_s``)."""
        t0 = time.perf_counter()
        self._built.wait()
        if not self.taken:
            self.record.waited_s, self.taken = time.perf_counter() - t0, True
        if self._error is not None:
            r = self.record
            raise NamError(f"the checkpoint host buffers ({r.nbytes / 1e9:.1f} GB, {r.how}) could not be built: "
                           f"{type(self._error).__name__}: {self._error}",
                           hint="check the host's free memory (free -g) and its locked-memory limit (ulimit -l); "
                                "--set train.async_checkpoints=false writes checkpoints on the training thread, "
                                "without them") from self._error
        t0 = time.perf_counter()
        shards = _shards(state)
        found = [(tuple(sh.data.shape), sh.data.dtype) for sh in shards]
        if found != self.specs:
            raise NamError(f"this save's sharded state ({len(found)} shards) is not the one its host buffers were "
                           f"made for ({len(self.specs)} shards): the first difference is at shard "
                           f"{next(i for i, (a, b) in enumerate(zip([*found, None], [*self.specs, None])) if a != b)}",
                           hint="the megatron engine keeps one state structure for a run; report this with run.log")
        with torch.no_grad():
            for sh, buf in zip(shards, self.buffers):
                buf.copy_(sh.data, non_blocking=self.pinned)
                sh.data = buf
        if self.pinned:
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def _save_aside(tmp: Path, models: list, optimizer, rank: int) -> None:
    """Collective: every rank's shards and RNG into the hidden folder ``tmp``."""
    from megatron.core import dist_checkpointing

    _aside(tmp, rank)
    state = _sharded_state(models, optimizer, is_loading=False)
    _write_optimizer_map(tmp, state, optimizer, rank)
    dist_checkpointing.save(state, str(tmp), verify_integrity=True)
    torch.distributed.barrier()


def _finish(tmp: Path, final: Path, ckpt_root: Path, step: int, manifest: dict, keep: int) -> None:
    """Rank 0: the manifest (sha256 of every file), the rename into place, the pruning."""
    for path in tmp.iterdir():  # on disk before the rename makes the folder count as good
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    files.fsync_dir(tmp / "rng")
    if (tmp / OPTIMIZER_MAP).is_dir():
        files.fsync_dir(tmp / OPTIMIZER_MAP)
    body = {"format": CHECKPOINT_FORMAT, "step": step, **manifest, "sha256": _digests(tmp)}
    with open(tmp / "manifest.json", "w") as f:
        f.write(json.dumps(body, indent=2))
        f.flush()
        os.fsync(f.fileno())
    files.fsync_dir(tmp)
    # Old folders are renamed aside (hidden) before they are deleted, as the local engine's are (``files._rename_in``,
    # ``files._remove``): a kill in the middle of a delete leaves a hidden leftover, never a damaged step-* (nor,
    # re-saving a step, no step at all); the next save removes such leftovers (one save is in flight at a time).
    for stale in ckpt_root.glob(".step-*.old-*"):
        shutil.rmtree(stale, ignore_errors=True)
    files._rename_in(tmp, final, ckpt_root)
    _VERIFIED.add(_verified_key(final, body["sha256"]))  # hashed just above: pruning need not hash it again
    for old in files.pruned(good_checkpoints(ckpt_root), final, keep):
        files._remove(old)


def resolve_resume(spec: str, ckpt_root: Path, *, warn: Callable[[str], None] | None = None) -> Path:
    """``auto`` -> the newest good megatron-engine checkpoint under ``ckpt_root``; a path -> that folder, if
    it is one (the layout is checked when it loads). ``warn`` gets a line for each newer checkpoint ``auto``
    skipped as damaged (what it lacked), as the local engine's resolve does."""
    return files.resolve_resume(
        spec, ckpt_root, good=good_checkpoints, what="megatron-engine checkpoint",
        is_good=lambda folder: inspect(folder)[0] is not None, why=lambda folder: inspect(folder)[1], warn=warn)


def load_checkpoint(folder: Path, models: list, optimizer, *, layout: dict, phases: dict | None = None,
                    notes: list | None = None, train=None) -> dict:
    """Restore the model chunks, optimizer and per-rank RNG from ``folder``; refuse another parallel layout.
    Needs the engine's patch lane in force (torch AdamW's state before a load and its steps after one; Megatron's
    reader made to read the files side by side). The gradient buffers are freed during the load; with Megatron's
    precision-aware optimizer the optimizer's state is made once, by Megatron's load, and its load targets stay on
    the GPU when the memory allows, else go to host memory (``targets_stay``; the comment below says why and how
    much). ``phases``, when given, gets the seconds of each part (``LOAD_PHASES``); ``notes`` gets where the
    targets went and why: both for the run log. ``train``: this run's TrainConfig, whose lr, min_lr_ratio and
    weight_decay (fields a resume may change) the loaded param groups take (``this_runs_schedule``)."""
    from megatron.core import dist_checkpointing

    clock = _Phases(phases)
    manifest, why = inspect(folder)
    if manifest is None:
        raise RunFolderError(f"{folder} is not a complete megatron-engine checkpoint ({why})",
                             hint="resume from a folder listed by good_checkpoints, or start without --resume")
    if manifest.get("layout") != layout:
        raise NamError(f"{folder} was written with layout {manifest.get('layout')}, this run is {layout}",
                       hint="resume with the same GPUs, tp, pp and ep")
    refuse_unsafe_pickles(folder)
    clock.lap("check")
    with grads_released(models):
        targets = _sharded_state(models, optimizer, is_loading=True)
        if _copies_state(optimizer):
            state_bytes = _state_bytes(optimizer)
            release_state(optimizer)
            stay, why = targets_stay(state_bytes, _free_for_load())
            if not stay:
                targets_on_host(targets["optimizer"])
            if notes is not None:
                notes.append(why)
        clock.lap("targets")
        # integrity.json: Megatron's digests, written by synchronous saves only (nam's manifest, checked above by
        # inspect, holds the same for every save)
        state = dist_checkpointing.load(targets, str(folder), verify_integrity=(folder / "integrity.json").is_file())
        del targets
        clock.lap("read")
        with torch.no_grad():  # the optimizer copies into its main params, leaves that require grad
            for i, model in enumerate(models):
                unwrap(model).load_state_dict(state["model"] if len(models) == 1 else state["model"][f"model{i}"])
            clock.lap("model")
            if train is not None:
                this_runs_schedule(state["optimizer"], before=(manifest.get("record") or {}).get("train"), now=train)
            optimizer.load_state_dict(state["optimizer"])
            clock.lap("optimizer")
        del state
    rng = _rng_file(folder, torch.distributed.get_rank())
    files.set_rng_state(files.load_tensors(rng), source=rng)
    clock.lap("rest")
    return manifest


SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
"""Param-group fields that nam's resumable train fields set (``max_lr`` = lr, ``min_lr`` = lr * min_lr_ratio,
``start_wd`` / ``end_wd`` = weight_decay, as ``optimizer.build_optimizer`` and the fp32 groups' override ask) and
that Megatron-Core 0.19's ``DistributedOptimizer.load_state_dict`` matches saved groups to this run's by
(``param_group_identifier_keys``): a resume with another lr or weight decay found no saved group and stopped on
a KeyError."""


def this_runs_schedule(saved, *, before: dict | None, now) -> None:
    """In place, the loaded optimizer state's param groups with this run's ``SCHEDULE_KEYS`` values: each value
    the checkpoint's run set from its train config (``before``, the manifest's record) becomes the one this run
    sets from ``now``, so Megatron pairs the groups as if nothing changed; nam sets lr and weight decay itself at
    every step, so nothing else reads them. Values nam did not set (None, another multiplier) are left."""
    if not before:
        return
    old = {"max_lr": before["lr"], "min_lr": before["lr"] * before["min_lr_ratio"],
           "start_wd": before["weight_decay"], "end_wd": before["weight_decay"]}
    new = {"max_lr": now.lr, "min_lr": now.lr * now.min_lr_ratio, "start_wd": now.weight_decay,
           "end_wd": now.weight_decay}

    def groups(node):
        if isinstance(node, dict):
            if isinstance(node.get("param_groups"), list):
                yield from node["param_groups"]
            for value in node.values():
                yield from groups(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                yield from groups(value)

    for group in groups(saved):
        for key in SCHEDULE_KEYS:
            if group.get(key) is not None and group[key] == old[key]:
                group[key] = new[key]


LOAD_PHASES = ("check", "targets", "read", "model", "optimizer", "rest")
"""``load_checkpoint``'s parts, in order: the folder's check (manifest, sha256 unless this process hashed it,
pickles), the load targets (Megatron's sharded state, moved to the host), Megatron's read of the files into them,
the model's and the optimizer's ``load_state_dict``, the rest (gradient buffers made again, the RNG)."""


class _Phases:
    """Seconds between ``lap`` calls, each under its name in ``into`` (a no-op when ``into`` is None); on CUDA
    each lap waits for the device first, so a part's copies are counted in that part."""

    def __init__(self, into: dict | None):
        self.into, self.last = into, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.into is None:
            return
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.into[name] = now - self.last
        self.last = now


# --- what the load holds on the GPU ------------------------------------------------------------------------
#
# One H200, full NAM56R (N = 4.73e9 parameters, all in one distributed optimizer at EP 1; 1 byte per parameter =
# 4.40 GiB), bf16-moments (Megatron's precision-aware optimizer on TE's FusedAdam), before the first step (no
# activations), in bytes per parameter, Megatron-Core 0.19.2 and TE 2.20.2 as read (tests/megatron_gloo/
# fused_adam.py's ledger measures the optimizer's part on the CPU):
#   weights 2 (bf16 param buffer) + gradients 4 (fp32 grad buffer) + the optimizer's state 6 (bf16 exp_avg and
#   exp_avg_sq, int16 master remainders) = 12 (53 GiB), what training holds besides activations.
#   ``sharded_state_dict(is_loading=True)`` makes that state through ``load_state_dict`` on its empty-state path
#   (torch.empty dummies 6, the state 6) and its load targets with FusedAdam's ``get_unscaled_state``: fp32 copies
#   of both moments, 8, held through the load: 20 (88 GiB). ``optimizer.load_state_dict`` (the state allocated
#   now) then reads FusedAdam's ``state_dict()``, fp32 copies of both moments again (8), and torch's
#   ``Optimizer.load_state_dict`` casts them and the remainders to the weights' bf16 (6) before FusedAdam makes
#   its state afresh: 34 (150 GiB) wanted; out of memory at 130.9 GiB in use (round 6).
# What ``load_checkpoint`` does instead: the gradient buffers are freed for the load (Megatron's
# ``offload_grad_buffers``: they hold nothing before the first step) and the optimizer's state is dropped once
# Megatron has made the targets, so that ``optimizer.load_state_dict`` makes it once on its empty-state path
# (dummies 6, the remainders' bf16 casts 2, the state 6: ``REBUILD`` = 14/6 of the state) and copies the
# checkpoint's values into it. With the targets on the GPU: 2 (weights) + 8 (targets) + 14 = 24 (106 GiB; 108.0
# measured, round 12), and the load converts on the GPU (optimizer part 0.3 s). With the targets in host memory
# (47 GB there: the fp32 moments, the int16 remainders): 2 + 6 + 8 = 16 before the move, 2 + 14 = 16 in the
# rebuild (70.6 GiB measured, round 11), but FusedAdam converts them on the host and copies them from pageable
# memory (optimizer part 6.2 s, round 12). ``targets_stay`` keeps them on the GPU when the rebuild fits.

REBUILD = 7 / 3
"""What ``optimizer.load_state_dict`` allocates on the GPU while rebuilding a released precision-aware state, as a
multiple of that state's bytes (the comment above; the gloo suite's ledger measures it)."""
LOAD_MARGIN = 2 << 30
"""Bytes left free beyond the rebuild's when the targets stay on the GPU (the kernels' workspaces, the caching
allocator's rounding)."""


def _state_bytes(optimizer) -> int:
    """Bytes of every inner optimizer's per-parameter state tensors."""
    return sum(t.numel() * t.element_size()
               for inner in getattr(optimizer, "chained_optimizers", [optimizer])
               if getattr(inner, "optimizer", None) is not None
               for per_param in inner.optimizer.state.values() for t in per_param.values()
               if isinstance(t, torch.Tensor))


def _free_for_load() -> int | None:
    """Bytes this process can still allocate on its GPU: the driver's free memory plus what torch's caching
    allocator holds unused (the released state's blocks); None when the engine's device is not CUDA."""
    if parallel.device().type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def targets_stay(state_bytes: int, free: int | None) -> tuple[bool, str]:
    """Whether the precision-aware optimizer's load targets stay on the GPU: when the state's rebuild
    (``REBUILD`` times ``state_bytes``) and ``LOAD_MARGIN`` fit in ``free`` (``_free_for_load``; None: no GPU, the
    targets are host memory already). The reason, for the run log, either way."""
    need = REBUILD * state_bytes + LOAD_MARGIN
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    if free is None:
        return False, "optimizer load targets in host memory (no GPU)"
    if free >= need:
        return True, (f"optimizer load targets on the GPU: the state's rebuild needs {gib(need)}, {gib(free)} "
                      "free")
    return False, (f"optimizer load targets in host memory: the state's rebuild needs {gib(need)} with them on "
                   f"the GPU, {gib(free)} free; the load converts them on the host (slower: bench/README.md, "
                   "round 12)")


@contextlib.contextmanager
def grads_released(models: list):
    """For the ``with`` block: every DDP chunk's gradient buffers freed (Megatron's ``offload_grad_buffers``: their
    storage resized to 0, every ``main_grad`` view kept) and made again, zeroed, on the way out
    (``restore_grad_buffers``). For a load before the first step, when they hold nothing."""
    from nam_core.engine.megatron import parallel

    cuda = parallel.device().type == "cuda"
    for model in models:
        model.offload_grad_buffers(synchronize=cuda, empty_cache=False)
    try:
        yield
    finally:
        for model in models:
            model.restore_grad_buffers(synchronize=cuda)
        if cuda:  # the load's transients back to the driver: the first step allocates into a clean pool
            torch.cuda.empty_cache()


def _copies_state(optimizer) -> bool:
    """Whether Megatron's load of ``optimizer`` goes through copies of its state: its precision-aware optimizer,
    where TE's FusedAdam holds the state (``get_unscaled_state`` and ``state_dict`` give fp32 copies of bf16
    moments, ``load_state_dict`` casts and rebuilds)."""
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(getattr(getattr(o, "config", None), "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)
               for o in inners)


def targets_on_host(optimizer_targets: dict) -> int:
    """Every load target of the optimizer's sharded state (its ``ShardedTensor``s: with Megatron's precision-aware
    optimizer, fp32 copies of the moments, the live remainders, padding) replaced by an empty tensor of the same
    shape and dtype in host memory, for ``dist_checkpointing.load`` to fill; returns how many. The GPU copies are
    freed as each is replaced (those that are copies)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    moved = 0
    for target in nested_values(optimizer_targets):
        if isinstance(target, ShardedTensor) and target.data is not None:
            target.data = None
            target.init_data(torch.device("cpu"))
            moved += 1
    return moved


def release_state(optimizer) -> None:
    """Every inner optimizer's per-parameter state dropped (``optimizer.state`` emptied), so that Megatron's
    ``DistributedOptimizer.load_state_dict`` allocates it on its empty-state path, once, instead of copying the
    live state through ``state_dict()`` and back (module comment above ``grads_released``). Only for an optimizer
    whose load targets are copies of its state (``_copies_state``), once the targets are made."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "optimizer", None) is not None:  # None: a stub (a rank without parameters to update)
            inner.optimizer.state.clear()


_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
"""The distributed optimizer's items in a checkpoint's index (``chained_<i>.optimizer.distributed...`` when the
model has expert and dense parameters, ``optimizer....`` otherwise); every other tensor is the model's."""


def model_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's tensors of a good megatron-engine checkpoint, each whole (every rank's shards put together:
    dist-checkpointing stores a tensor under one key with its global shape, experts of every EP rank and layers
    of every pipeline stage under their global numbers), under Megatron's names, and the manifest. Read in this
    one process, without Megatron or a process group (``nam export``); Megatron's ``_extra_state`` bytes are
    not read. A torn or altered folder is refused as ``load_checkpoint`` refuses it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest, why = inspect(folder)
    if manifest is None:
        raise RunFolderError(f"{folder} is not a complete megatron-engine checkpoint ({why})",
                             hint=f"export a good one: ls {folder.parent}")
    refuse_unsafe_pickles(folder)
    reader = _reader(folder)
    index = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in index.items()
             if isinstance(v, TensorStorageMetadata) and not _OPTIMIZER_KEY.match(k)}
    with warnings.catch_warnings():  # one process without a process group, by design
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_reader(folder), no_dist=True)
    return state, manifest


def optimizer_tensors(folder: Path) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """Adam's state of a good megatron-engine checkpoint per model tensor, each whole, under Megatron's checkpoint
    keys: ``{key: {"param": fp32 main weights, "exp_avg": ..., "exp_avg_sq": ...}}``, and Adam's step count (torch's
    AdamW or Transformer Engine's FusedAdam on Megatron's fp32 main params: the same state).
    Read in this one process from the flat bucket tensors with the ranks' ``OPTIMIZER_MAP``; refused (NamError)
    for a checkpoint without a complete map (saved by an earlier nam, or with an optimizer whose shards are not
    plain tensors), and if any element of a parameter is not covered."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest, why = inspect(folder)
    if manifest is None:
        raise RunFolderError(f"{folder} is not a complete megatron-engine checkpoint ({why})",
                             hint=f"export a good one: ls {folder.parent}")
    maps = [json.loads(p.read_text()) for p in sorted((folder / OPTIMIZER_MAP).glob("rank-*.json"))]
    world = manifest.get("layout", {}).get("world_size")
    again = (f"resume it with this nam (--resume {folder}) and let it checkpoint once, or export its weights "
             f"alone: nam export {folder} --out DIR")
    if len(maps) != world or not all(m["complete"] for m in maps):
        found = next((m["why"] for m in maps if not m["complete"]), f"{len(maps)} of {world} ranks' maps")
        hint = next((m["hint"] for m in maps if m.get("hint")), None)
        older = "" if hint else "; checkpoints saved by an earlier nam have none"
        raise RunFolderError(f"{folder}: its optimizer state cannot be read per parameter ({found} in "
                             f"{OPTIMIZER_MAP}/{older})", hint=hint or again)
    steps = {s for m in maps for s in m["steps"]}
    if len(steps) != 1:
        raise RunFolderError(f"{folder}: Adam's step counts differ between parameters or groups, or none was "
                             f"recorded ({sorted(steps)[:4]} in {OPTIMIZER_MAP}/; one expected)", hint=again)
    refuse_unsafe_pickles(folder)
    index = _reader(folder).read_metadata().state_dict_metadata
    kinds = ("param", "exp_avg", "exp_avg_sq")
    buckets = {f"{e['bucket']}.{k}" for m in maps for e in m["entries"] for k in kinds}
    missing = sorted(k for k in buckets if not isinstance(index.get(k), TensorStorageMetadata))
    if missing:
        raise RunFolderError(f"{folder}: the optimizer map names bucket tensors the checkpoint lacks: {missing[:3]}",
                             hint=again)
    flat = {k: torch.empty(index[k].size, dtype=index[k].properties.dtype) for k in buckets}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=_reader(folder), no_dist=True)
    out: dict[str, dict[str, torch.Tensor]] = {}
    covered: dict[str, torch.Tensor] = {}
    for entry in (e for m in maps for e in m["entries"]):
        key, shape = entry["param"], index[entry["param"]].size
        if entry["offset"] is None:  # a factory's tensor: this rank held it whole, or it cannot be placed here
            if tuple(shape) != tuple(entry["shape"]):
                raise RunFolderError(f"{folder}: {key} is split over ranks by a Megatron factory "
                                     f"({tuple(entry['shape'])} of {tuple(shape)}), which this reader does not "
                                     "place", hint=again)
            entry = {**entry, "offset": [0] * len(shape)}
        if key not in out:
            out[key] = {k: torch.zeros(shape, dtype=flat[f"{entry['bucket']}.{k}"].dtype) for k in kinds}
            covered[key] = torch.zeros(shape, dtype=torch.bool)
        pre = entry["prepend"]
        place = tuple(entry["offset"][:pre]) + tuple(slice(o, o + n) for o, n in
                                                      zip(entry["offset"][pre:], entry["shape"]))
        span = slice(entry["start"], entry["start"] + entry["numel"])
        for k in kinds:
            local = out[key][k][place].clone().reshape(-1)
            local[span] = flat[f"{entry['bucket']}.{k}"][entry["at"]:entry["at"] + entry["numel"]]
            out[key][k][place] = local.reshape(entry["shape"])
        local = covered[key][place].clone().reshape(-1)
        local[span] = True
        covered[key][place] = local.reshape(entry["shape"])
    partial = sorted(k for k, c in covered.items() if not bool(c.all()))
    if partial:
        raise RunFolderError(f"{folder}: the optimizer state of {partial[:3]} is not covered by the ranks' maps",
                             hint=again)
    return out, steps.pop()


def _reader(folder: Path):
    """torch's file reader for a dist-checkpointing folder, its ``.metadata`` read by ``_MetadataUnpickler``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(folder / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(folder))


# --- what Megatron's loader unpickles, read first under restricted unpicklers ---------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_TORCH_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
                  ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}  # StorageMeta.checkpoint_id


class _MetadataUnpickler(pickle.Unpickler):
    """Rebuilds a torch.distributed.checkpoint ``Metadata``: its own dataclasses and enums, ``torch.Size``,
    dtypes and layouts, and nothing else (a global outside those is refused before anything is called)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _TORCH_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in _DCP_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__ == module and (
                    is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def refuse_unsafe_pickles(folder: Path) -> None:
    """RunFolderError if ``.metadata`` or any byte item it lists would make Megatron's load run more than
    rebuilding metadata, tensors and plain values. Reads the same bytes the load will read."""
    path = folder / ".metadata"
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as e:
        raise _unsafe(path, e) from e
    except OSError as e:
        raise RunFolderError(f"{path}: cannot be read ({e.strerror})",
                             hint="resume from another checkpoint or start without --resume") from e
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_items = {fqn for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
    for index, info in metadata.storage_data.items():
        if index.fqn not in byte_items:
            continue
        where = folder / info.relative_path
        if getattr(info, "transform_descriptors", None):  # compressed or encrypted: not read here
            raise _unsafe(where, f"byte item {index.fqn!r} is stored with transforms {info.transform_descriptors}")
        with open(where, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        try:
            torch.load(io.BytesIO(blob), weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
            raise _unsafe(where, f"byte item {index.fqn!r} {files._globals_named(io.BytesIO(blob))}") from e


def _unsafe(path: Path, why) -> RunFolderError:
    return RunFolderError(f"{path}: refused to load, it asks for more than checkpoint metadata, tensors and plain "
                          f"values ({why})",
                          hint="a nam checkpoint never does: this folder was written by something else or altered; "
                               "resume from another checkpoint or start without --resume")
