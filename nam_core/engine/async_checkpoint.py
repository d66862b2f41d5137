"""Local-engine checkpoints that do not stop training: torch.distributed.checkpoint (DCP) with its async save.

Layout (format 3; nam_core/engine/checkpoint.py still reads formats 1 and 2)::

    checkpoints/step-00000060/   manifest.json   state/.metadata   state/__0_0.distcp

A save costs the training thread one copy of the state to host memory (DCP's blocking stager; on CUDA into
pinned buffers kept between saves, as torchtitan does); a background thread writes the files, hashes them, writes
the manifest (the sha256 of every file, nam's run record) and renames the hidden ``.step-N.tmp-<pid>`` folder
into place. Until then the folder is hidden, so a kill mid-write leaves the previous checkpoint the newest good
one. One save is in flight at a time: the next save, the end of the run and a stop wait for it, and an error in
the background (a full disk) surfaces there, as ``save`` would have raised it, with the half-written folder
removed.

DCP runs in this one process without a process group: ``no_dist=True`` (torch 2.13 asks for nothing else; with
a process group initialized, ``async_save`` would want a CPU backend in it).

Loading never unpickles an arbitrary object. DCP keeps its index (``.metadata``) as a pickle and reads it with
``pickle.load`` (torch 2.13, ``FileSystemReader.read_metadata``), and its default planner loads non-tensor values
with ``torch.load(weights_only=False)``. ``SafeReader`` unpickles ``.metadata`` with an allowlist of the classes
DCP's index is made of (``_INDEX_CLASSES``: dataclasses of plain fields, torch.Size, dtypes, a path), and
``SafeLoadPlanner`` loads values with ``weights_only=True``. Before either, ``checkpoint.verify`` has matched every
file's sha256 with the manifest, so a torn or corrupt file is skipped with a warning rather than half-read; the
allowlist is what stops a crafted one, whose manifest an attacker could rewrite as well.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import signal
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

FORMAT = 3
STATE = "state"  # the DCP folder inside a checkpoint folder

# DCP warns on every save and load without a process group that it assumes one process: that is this engine's
# case by design (no_dist=True). Filtered by its message, process-wide, because the save's warning comes from
# the background writer thread, where a catch_warnings block on the training thread does not reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "TensorStorageMetadata",
                                              "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
              "bool", "strided", "contiguous_format", "preserve_format"},
    "torch.serialization": {"_get_layout"},  # how a layout (torch.strided) pickles
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}
"""(module, name) pairs a DCP ``.metadata`` pickle may name, found by listing what torch 2.13 writes for nam's
state (the dataclasses of ``torch.distributed.checkpoint.metadata`` and what their fields hold). Any other global
refuses the load."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _INDEX_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def _readers():
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeReader(FileSystemReader):
        """DCP's file reader, its ``.metadata`` unpickled through ``_IndexUnpickler``."""

        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = _IndexUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            if metadata.planner_data is None:
                metadata.planner_data = {}
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's load planner with non-tensor values (param groups, the scheduler's numbers) read by
        ``torch.load(weights_only=True)``: plain containers and numbers, no code."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses

            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    class Writer(FileSystemWriter):
        """DCP's file writer, one file per rank, fsynced; with the fault hooks of tests/test_faults.py."""

        def write_data(self, plan, planner):
            _fault_injection(Path(self.path))
            return super().write_data(plan, planner)

    return SafeReader, SafeLoadPlanner, Writer


def _fault_injection(path: Path) -> None:
    """Tests: NAM_TEST_KILL_DURING_SAVE=N SIGKILLs this process from the background writer of step N's save;
    NAM_TEST_DISK_FULL_DURING_SAVE=N raises the kernel's ENOSPC there."""
    step = path.parent.name.split(".")[1].split("-")[1] if path.parent.name.startswith(".step-") else None
    if step is None:
        return
    if os.environ.get("NAM_TEST_KILL_DURING_SAVE") == str(int(step)):
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("NAM_TEST_DISK_FULL_DURING_SAVE") == str(int(step)):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def state_dicts(model, optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's own state dicts (the optimizer's by parameter index, with the fp32 masters
    of ``train.optimizer_numerics=fp32-master`` in it: nam_core/engine/numerics.py; its parameters are the
    masters, not the model's, so DCP's name-keyed ``get_state_dict`` cannot map them). An empty optimizer state
    (a fresh optimizer before a load) is created first, so the load has tensors of the right shapes to read into."""
    _materialize(optimizer)
    return model.state_dict(), optimizer.state_dict()


def _materialize(optimizer) -> None:
    """Create an empty optimizer's state: one step on zero gradients at lr 0 (AdamW's decay is lr x weight decay:
    no parameter moves), then the gradients dropped. Refuses (RuntimeError) an optimizer that still has none."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        raise RuntimeError("an optimizer with gradients but no state: a load must come before the first backward")
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    if not optimizer.state:
        raise RuntimeError(f"{type(optimizer).__name__} created no state from a step: nothing to load a checkpoint into")


@dataclass
class PendingSave:
    """A save whose files are being written in the background; ``wait()`` returns its final folder."""

    step: int
    final: Path
    tmp: Path
    done: Future
    stall_s: float
    """What the training thread paid: the copy of the state to host memory."""
    started: float = field(default_factory=time.perf_counter)

    def wait(self) -> Path:
        """The final folder; a failed write's error (an OSError itself when DCP wrapped one: a full disk)."""
        try:
            self.done.result()
        except BaseException as e:  # DCP's CheckpointException is a BaseException; re-raised, an OSError unwrapped
            raise os_error(e) or e
        return self.final


def os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc`` (a full disk during the write), itself or inside DCP's wrapper."""
    return _inner(exc, OSError)


def _inner(exc: BaseException | None, kind: type, seen: set | None = None):
    """``exc`` when it is a ``kind``, else the first one behind it: in a rank's failure of DCP's
    CheckpointException (``failures``: rank -> exception, or (exception, traceback)), or in an exception's
    cause or context (on a real full disk, torch.save fails closing its archive, "unexpected pos", with the
    OSError as that error's context); None when there is none."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return None
    seen.add(id(exc))
    if isinstance(exc, kind):
        return exc
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException) and (found := _inner(inner, kind, seen)) is not None:
            return found
    return _inner(exc.__cause__, kind, seen) or _inner(exc.__context__, kind, seen)


def _loading(folder: Path):
    """Around a DCP load: a refused index or value (``_IndexUnpickler``, ``weights_only``) is a RunFolderError
    that names the checkpoint, whatever DCP wrapped it in."""
    import contextlib

    from nam_core.errors import RunFolderError

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            refused = _inner(e, pickle.UnpicklingError)
            if refused is None:
                raise
            raise RunFolderError(
                f"{folder}: refused to load, its files ask for more than a checkpoint holds ({refused})",
                hint="a nam checkpoint never does: it was written by something else or altered; resume from another "
                     "checkpoint or start without --resume") from e

    return guard()


class AsyncSaver:
    """One run's checkpoint writer: at most one save in flight, staging buffers kept between saves on CUDA."""

    def __init__(self, *, pinned: bool):
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        self.stager = BlockingAsyncStager(cache_staged_state_dict=pinned)
        self.pending: PendingSave | None = None

    def start(self, tmp: Path, final: Path, step: int, state: dict,
              finish: Callable[[Path, Path], None]) -> PendingSave:
        """Stage ``state`` (training thread) and write it under ``tmp/state`` in the background; then
        ``finish(tmp, final)`` (manifest, rename, prune) in the same background thread."""
        import torch.distributed.checkpoint as dcp

        _, _, Writer = _readers()
        t0 = time.perf_counter()
        writer = Writer(str(tmp / STATE), single_file_per_rank=True, sync_files=True, thread_count=1)
        upload = dcp.async_save(state, storage_writer=writer, async_stager=self.stager, no_dist=True)
        upload = upload if isinstance(upload, Future) else upload.upload_completion
        stall = time.perf_counter() - t0
        done: Future = Future()

        def finished(f: Future) -> None:  # in the writer's thread
            try:
                f.result()
                finish(tmp, final)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
                shutil.rmtree(tmp, ignore_errors=True)
                done.set_exception(e)
            else:
                done.set_result(final)

        upload.add_done_callback(finished)
        self.pending = PendingSave(step, final, tmp, done, stall)
        return self.pending

    def wait(self) -> Path | None:
        """The newest save's final folder once it is on disk (None when none is pending); its error if it failed."""
        pending, self.pending = self.pending, None
        return pending.wait() if pending is not None else None


def load(folder: Path, *, model, optimizer, scheduler, rng_template: dict) -> dict:
    """Model, optimizer, scheduler and RNG state from a verified format-3 folder (through ``SafeReader`` and
    ``SafeLoadPlanner``); returns the RNG state for ``checkpoint.set_rng_state``."""
    import torch.distributed.checkpoint as dcp

    SafeReader, SafeLoadPlanner, _ = _readers()
    model_sd, optim_sd = state_dicts(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(), "rng": rng_template}
    with _loading(folder):
        # Read the index first: torch 2.13's load folds a failed index read into an AssertionError's text.
        SafeReader(str(folder / STATE)).read_metadata()
        dcp.load(state, storage_reader=SafeReader(str(folder / STATE)), planner=SafeLoadPlanner(), no_dist=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["rng"]


def read_flat(folder: Path, prefix: str = "") -> dict:
    """Every value of a format-3 folder whose flattened name starts with ``prefix`` (``model.``,
    ``optimizer.state.``, ...), without a model or an optimizer to load into: tensors as saved, other values as
    plain Python ones (``nam export``; tests compare two checkpoints with it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    SafeReader, SafeLoadPlanner, _ = _readers()
    with _loading(folder):
        index = SafeReader(str(folder / STATE)).read_metadata().state_dict_metadata
        state = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
                 for k, v in index.items() if k.startswith(prefix)}
        dcp.load(state, storage_reader=SafeReader(str(folder / STATE)), planner=SafeLoadPlanner(), no_dist=True)
    return state


def state_files(folder: Path) -> list[str]:
    """The files of a format-3 checkpoint the manifest hashes, relative to its folder."""
    root = folder / STATE
    return sorted(f"{STATE}/{p.name}" for p in root.iterdir() if p.is_file()) if root.is_dir() else []


def write_manifest(tmp: Path, manifest: dict) -> None:
    from nam_core.files import fsync_dir

    with open(tmp / "manifest.json", "w") as f:
        f.write(json.dumps(manifest, indent=2))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp / STATE)
    fsync_dir(tmp)

