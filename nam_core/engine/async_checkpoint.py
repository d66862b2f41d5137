"""Local-engine checkpoints that do not stop training: torch.distributed.checkpoint (DCP) with its async save.

Layout (format 3; nam_core/engine/checkpoint.py still reads formats 1 and 2)::

    checkpoints/step-00000060/   manifest.json   state/.metadata   state/__0_0.distcp ... state/__0_7.distcp (FILES)

A save costs the training thread one copy of the state to host memory (DCP's blocking stager, into host buffers
kept between saves, as torchtitan does); a background thread writes the files, hashes them, writes
the manifest (the sha256 of every file, nam's run record) and renames the hidden ``.step-N.tmp-<pid>`` folder
into place. Until then the folder is hidden, so a kill mid-write leaves the previous checkpoint the newest good
one. One save is in flight at a time: the next save, the end of the run and a stop wait for it, and an error in
the background (a full disk) surfaces there, as ``save`` would have raised it, with the half-written folder
removed. The data is ``FILES`` files written by as many threads (an error in any of them fails the save:
``Writer``), hashed side by side, and read back by one thread per file (``SafeReader.read_data``): what a resume
waits for before its first step.

The host buffers (a CPU mirror of the state dict, 27 GB for full NAM56R at bf16 numerics; page-locked on CUDA, so
the device-to-host copy runs at DMA speed) are built once per process, on a background thread, as soon as the
engine calls ``AsyncSaver.prepare`` (after the first optimizer step, when the optimizer's state exists): the
first save finds them ready instead of allocating them on the training thread (25.5 s for 27 GB on one H200,
bench/README.md). A save that comes before the build ends waits for it, and ``PendingSave.buffers`` says how long
(the engine writes it to run.log). Built by torch's own ``_create_cpu_state_dict`` (what DCP's
``BlockingAsyncStager`` calls at its first stage), page-locked with ``cudaHostAlloc`` (``HOST_BUFFERS =
"alloc"``: exactly what the stager allocated on the training thread before, measured on our GPU host). The other
way, ``"register"``, makes them pageable, touches every page, then locks them one tensor at a time with
``cudaHostRegister`` (``torch.cuda._pin_memory_utils``, what torch's ``StateDictStager`` uses): ``cudaHostAlloc``
maps and locks pages while it holds the CUDA driver's lock, which can hold up the training thread's launches
while the build runs, and registering pages already touched holds it for less (torch's reason for its
``pinned_use_cuda_host_register`` allocator option). Neither is measured on a background thread yet: ``bench/host_buffers.py``
measures both (the build's time, what it costs a training thread meanwhile, the copy's speed), and the faster
one that does not stall training becomes ``HOST_BUFFERS``. A failed build (the host out of memory, a locked-memory
limit) fails the first save with a NamError: no silent pageable fallback.

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
import math
import mmap
import os
import pickle
import shutil
import signal
import threading
import time
import warnings
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

FORMAT = 3
STATE = "state"  # the DCP folder inside a checkpoint folder
FILES = 8
"""Data files per checkpoint (DCP's ``thread_count``: its items split into this many files by size, written by
as many threads): a resume hashes them (checkpoint.hash_files) and reads them (``SafeReader``) side by side.
Checkpoints of one file (before 2026-11-28) load the same way."""

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

        def read_data(self, plan, planner):
            """DCP's read, one thread per data file (torch 2.13 reads the files one after the other): ``read_per_file``
            over this reader's own ``read_data``; the planner's ``load_bytes`` sets distinct keys."""
            return read_per_file(super().read_data, self.storage_data, plan, planner, threads=FILES)

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's load planner with non-tensor values (param groups, the scheduler's numbers) read by
        ``torch.load(weights_only=True)``: plain containers and numbers, no code."""

        _setting = threading.Lock()  # SafeReader's threads: set_element may grow a shared list

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner uses

            loaded = torch.load(value, weights_only=True)
            with self._setting:
                if self.flatten_state_dict:
                    set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
                else:
                    self.state_dict[read_item.dest_index.fqn] = loaded

    class Writer(FileSystemWriter):
        """DCP's file writer, ``FILES`` files written by as many threads, fsynced; with the fault hooks of
        tests/test_faults.py. torch 2.13's writer loses an error raised in one of its helper threads (the
        thread dies, its file's items are missing from the results, and the save would go on to write an index
        that lacks them): every file's error is kept here (``create_stream``) and raised, and a save whose
        results do not cover its plan fails."""

        def __init__(self, *args, **kwargs):
            import contextlib

            super().__init__(*args, **kwargs)
            self.failures: list[Exception] = []
            opened, failures = self.fs.create_stream, self.failures

            @contextlib.contextmanager
            def create_stream(path, mode):
                try:
                    with opened(path, mode) as stream:
                        yield stream
                except Exception as e:  # any write error: kept for write_data, and raised on
                    failures.append(e)
                    raise

            self.fs.create_stream = create_stream

        def write_data(self, plan, planner):
            _fault_injection(Path(self.path))
            written = super().write_data(plan, planner)
            if self.failures:
                raise self.failures[0]
            missing = {item.index for item in plan.items} - {result.index for result in written.wait()}
            if missing:
                raise RuntimeError(f"{len(missing)} of the checkpoint's {len(plan.items)} items were not written "
                                   f"(a writer thread failed before opening its file; its traceback is on stderr): "
                                   f"{', '.join(sorted(str(m.fqn) for m in missing)[:3])}")
            return written

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
    """What the training thread paid: the copy of the state to host memory, and the wait for the host buffers
    when this save was the one that took them (``buffers``)."""
    started: float = field(default_factory=time.perf_counter)
    buffers: "HostBuffers | None" = None
    """The host buffers' build, on the save that took them into use (the first of the process); None after."""

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


HOST_BUFFERS = "alloc"
"""How pinned host buffers are page-locked: ``"alloc"`` (``cudaHostAlloc`` through torch's pinned allocator, as
DCP's stager does; measured on our GPU host) or ``"register"`` (``registered_buffers``: a shared mapping, each
tensor on pages of its own, touched, then ``cudaHostRegister`` per tensor; the megatron engine's way; not yet
measured in this engine: r13's one run copied into pages ``host_mirror`` had already let go of, a bug since
fixed). Not a setting: ``bench/host_buffers.py`` and ``bench/checkpoint.py --host-buffers`` set it to compare the
two on a GPU."""


@dataclass
class HostBuffers:
    """The build of one process's host buffers, for run.log."""

    nbytes: int
    how: str
    """``pageable``, ``register`` or ``alloc`` (``HOST_BUFFERS``)."""
    built_s: float | None = None
    """The build's own time, on its thread; None until it ends."""
    waited_s: float = 0.0
    """What the save that took them waited for the build to end (0.0 when it found them ready)."""


def _tensors(obj):
    """Every tensor of a state dict (dicts, lists, tuples), depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def read_per_file(read: Callable, storage_data: dict, plan, planner, *, threads: int):
    """A DCP reader's ``read_data`` split by data file: ``read`` (the reader's own ``read_data``) runs once per file
    on that file's items, on a thread of its own, ``threads`` at once, each into its own targets. A file's error is
    raised here (the first in plan order) once every thread has stopped. Returns the finished future DCP waits
    on. One file: ``read`` as is. Both engines' loads read this way (the megatron engine's through its patch
    ``megatron-checkpoint-reads-in-turn``)."""
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed.checkpoint.planner import LoadPlan

    per_file: dict[str, list] = {}
    for item in plan.items:
        per_file.setdefault(storage_data[item.storage_index].relative_path, []).append(item)
    if len(per_file) <= 1:
        return read(plan, planner)
    parts = [LoadPlan(items, plan.storage_data, plan.planner_data) for items in per_file.values()]
    with ThreadPoolExecutor(min(threads, len(parts)), thread_name_prefix="nam-ckpt-read") as pool:
        reads = [pool.submit(read, part, planner) for part in parts]
    for done in reads:
        done.result().wait()
    finished = torch.futures.Future()
    finished.set_result(None)
    return finished


PAGE = mmap.PAGESIZE


def _register(ptr: int, size: int) -> None:
    """Page-lock ``size`` bytes at ``ptr`` for CUDA (``cudaHostRegister``, portable)."""
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.pin_memory(ptr, size)


def _unregister(ptr: int) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(ptr)


def page_layout(specs: list) -> tuple[list[int], int]:
    """Each tensor's byte offset in one mapping, every tensor starting on a page of its own (two registrations may
    not share a page: CUDA refuses a page registered twice), and the mapping's size."""
    offsets, end = [], 0
    for shape, dtype in specs:
        offsets.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // PAGE) * PAGE  # an empty tensor: no page
    return offsets, end


def registered_buffers(specs: list) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Page-locked host tensors of the ``(shape, dtype)`` in ``specs``, made so that a training thread's CUDA calls
    are not held up meanwhile (both engines build them on a background thread): one shared anonymous mapping
    (a forked writer shares it instead of copying its locked pages), each tensor on pages of its own and with a
    storage of its own (``torch.frombuffer``, which keeps the mapping alive), every page faulted in by zeroing (no
    CUDA call), then one ``cudaHostRegister`` per tensor, undone when the tensor goes. An empty tensor is a plain
    one (nothing to lock). Returns the tensors and the seconds of the two steps (``pages touched``,
    ``registered``). ``cudaHostAlloc`` instead (torch's pinned allocator) held up training for the whole build: a
    42.9 s step of full NAM56R (one H200, bench/README.md round 9)."""
    t0 = time.perf_counter()
    offsets, size = page_layout(specs)
    mapping = mmap.mmap(-1, size) if size else None
    buffers = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "non-writable buffer": the mapping is writable
        for (shape, dtype), at in zip(specs, offsets):
            if math.prod(shape) == 0:  # frombuffer refuses a count of 0
                buffers.append(torch.empty(shape, dtype=dtype))
                continue
            buf = torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape), offset=at).view(shape)
            buf.zero_()
            buffers.append(buf)
    t1 = time.perf_counter()
    for buf in buffers:
        if buf.numel() == 0:
            continue
        _register(buf.data_ptr(), -(-buf.numel() * buf.element_size() // PAGE) * PAGE)
        # unlocked when the buffer goes; not at exit, after the CUDA context is gone
        weakref.finalize(buf, _unregister, buf.data_ptr()).atexit = False
    return buffers, {"pages touched": t1 - t0, "registered": time.perf_counter() - t1}


def host_mirror(state: dict, *, pinned: bool, how: str | None = None) -> dict:
    """A CPU state dict of ``state``'s structure with new, uninitialised tensors of the same shapes and dtypes
    (torch's ``_create_cpu_state_dict``: what ``BlockingAsyncStager`` caches), every page touched, so the first
    copy into it does not fault pages in; page-locked when ``pinned`` (``how``, default ``HOST_BUFFERS``).
    Reads only the shapes and dtypes of ``state``: safe on another thread while training updates the values."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    how = how or HOST_BUFFERS
    if pinned and how == "alloc":
        return _create_cpu_state_dict(state, pin_memory=True)
    if how not in ("register", "alloc"):
        raise ValueError(f"HOST_BUFFERS: expected 'register' or 'alloc', found {how!r}")
    mirror = _create_cpu_state_dict(state)  # the structure; its tensors get the buffers' storage when pinned
    tensors = [t for t in _tensors(mirror) if t.numel()]
    if not pinned:
        for t in tensors:
            t.zero_()  # faults the pages in here, so the first copy into them is not slower
        return mirror
    buffers, _ = registered_buffers([(tuple(t.shape), t.dtype) for t in tensors])
    # the buffers themselves take the tensors' places: each unlocks its pages when it goes, so a tensor that only
    # shared a buffer's storage (``set_``) left the buffer to go at once and its pages unlocked under the mirror
    return _put_tensors(mirror, iter(buffers))


def _put_tensors(obj, new):
    """``obj`` with each non-empty tensor, depth first (``_tensors``' order), replaced by the next of ``new``: dicts
    and lists changed in place, tuples rebuilt."""
    if isinstance(obj, torch.Tensor):
        return next(new) if obj.numel() else obj
    if isinstance(obj, (dict, list)):
        for key in (obj.keys() if isinstance(obj, dict) else range(len(obj))):
            obj[key] = _put_tensors(obj[key], new)
        return obj
    if isinstance(obj, tuple):
        items = [_put_tensors(v, new) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def refit_mirror(mirror, state, *, pinned: bool) -> int:
    """Make ``mirror`` (a host mirror of an earlier ``state``) fit ``state`` again where it no longer does: a tensor
    whose shape or dtype changed (Transformer Engine's ``_extra_state``, its FP8 scaling metadata pickled into a
    uint8 tensor whose length varies from save to save) or an entry ``state`` gained gets a host tensor of its own,
    page-locked when ``pinned``; every other buffer is kept. Returns how many entries were replaced. Without this
    the stager's copy into the mirror fails on the first tensor whose size moved."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    replaced = 0

    def fresh(value):
        nonlocal replaced
        replaced += sum(1 for _ in _tensors(value)) or 1
        if isinstance(value, torch.Tensor):
            return torch.empty(value.shape, dtype=value.dtype, pin_memory=pinned)
        return _create_cpu_state_dict(value, pin_memory=pinned)

    def walk(m, s):
        if isinstance(s, torch.Tensor):
            fits = isinstance(m, torch.Tensor) and m.shape == s.shape and m.dtype == s.dtype
            return m if fits else fresh(s)
        if isinstance(s, dict):
            if not isinstance(m, dict):
                return fresh(s)
            for k, v in s.items():
                m[k] = walk(m[k], v) if k in m else fresh(v)
            return m
        if isinstance(s, list):
            if not isinstance(m, list) or len(m) != len(s):
                return fresh(s)
            for i, v in enumerate(s):
                m[i] = walk(m[i], v)
            return m
        return m if type(m) is type(s) else s  # plain values: the stager copies them from ``state`` as they are

    walk(mirror, state)
    return replaced


class AsyncSaver:
    """One run's checkpoint writer: at most one save in flight; host buffers built once, on a background thread
    (``prepare``), and kept between saves."""

    def __init__(self, *, pinned: bool):
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        # The cache is always ours (``host_mirror``, installed before the first stage), so the stager never
        # allocates on the training thread; pinned or not is ``self.pinned``.
        self.stager = BlockingAsyncStager(cache_staged_state_dict=True)
        self.pinned = pinned
        self.pending: PendingSave | None = None
        self.buffers: HostBuffers | None = None
        self._built: Future | None = None

    def prepare(self, state: dict) -> HostBuffers:
        """Start building the host buffers for ``state`` (the dict ``start`` will be given: same keys, shapes,
        dtypes) on a background thread; returns at once. Once per saver (later calls return the first build)."""
        if self.buffers is not None:
            return self.buffers
        how = (HOST_BUFFERS if self.pinned else "pageable")
        self.buffers = HostBuffers(sum(t.numel() * t.element_size() for t in _tensors(state)), how)
        built: Future = Future()
        buffers = self.buffers
        device = torch.cuda.current_device() if self.pinned else None  # the training thread's, for cudaHostRegister

        def build() -> None:
            t0 = time.perf_counter()
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                mirror = host_mirror(state, pinned=self.pinned, how=how if self.pinned else None)
            except BaseException as e:  # noqa: BLE001 - every way out of this thread settles ``built``, which the
                built.set_exception(e)  # first save raises: otherwise that save would wait for it forever
            else:
                buffers.built_s = time.perf_counter() - t0
                built.set_result(mirror)

        self._built = built
        threading.Thread(target=build, name="nam-host-buffers", daemon=True).start()
        return self.buffers

    def _take_buffers(self, state: dict) -> HostBuffers | None:
        """Before the first stage: the host buffers into the stager, waiting for their build (started now when
        ``prepare`` was never called); the build's record on that first save, None on later ones."""
        if self.stager.state_dict_cache is not None:
            return None
        buffers = self.prepare(state)
        t0 = time.perf_counter()
        try:
            mirror = self._built.result()
        except (RuntimeError, OSError, MemoryError) as e:  # allocating or locking host memory; a bug raises as is
            from nam_core.errors import NamError

            raise NamError(f"the checkpoint host buffers ({buffers.nbytes / 1e9:.1f} GB, {buffers.how}) could not be "
                           f"built: {type(e).__name__}: {e}",
                           hint="check the host's free memory (free -g) and its locked-memory limit (ulimit -l); "
                                "--set train.async_checkpoints=false writes checkpoints on the training thread, "
                                "without them") from e
        buffers.waited_s = time.perf_counter() - t0
        self.stager.state_dict_cache = mirror
        return buffers

    def start(self, tmp: Path, final: Path, step: int, state: dict,
              finish: Callable[[Path, Path], None]) -> PendingSave:
        """Stage ``state`` (training thread) and write it under ``tmp/state`` in the background; then
        ``finish(tmp, final)`` (manifest, rename, prune) in the same background thread."""
        import torch.distributed.checkpoint as dcp

        _, _, Writer = _readers()
        t0 = time.perf_counter()
        buffers = self._take_buffers(state)
        refit_mirror(self.stager.state_dict_cache, state, pinned=self.pinned)
        writer = Writer(str(tmp / STATE), single_file_per_rank=True, sync_files=True, thread_count=FILES)
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
        self.pending = PendingSave(step, final, tmp, done, stall, buffers=buffers)
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
        index = SafeReader(str(folder / STATE)).read_metadata().state_dict_metadata
        _fit_extra_states(model_sd, index)
        dcp.load(state, storage_reader=SafeReader(str(folder / STATE)), planner=SafeLoadPlanner(), no_dist=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["rng"]


def _fit_extra_states(model_sd: dict, index: dict) -> None:
    """A module's ``_extra_state`` tensor (Transformer Engine's pickled FP8 metadata) is loaded whole, at the
    length it was saved with, which differs from the fresh module's: the load reads in place, so each such entry
    gets an empty tensor of the saved size. Any other size mismatch stays an error of the load."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, value in model_sd.items():
        saved = index.get(f"model.{key}")
        if (key.rsplit(".", 1)[-1] == "_extra_state" and isinstance(value, torch.Tensor)
                and isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != tuple(value.shape)):
            model_sd[key] = torch.empty(saved.size, dtype=saved.properties.dtype)


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

