"""Atomic, verifiable checkpoints: written aside, fsynced, renamed into place, with a manifest.

Layout under the run folder::

    checkpoints/step-00000060/      manifest.json  state/.metadata  state/__0_0.distcp ... __0_7.distcp   (format 3)
    checkpoints/step-00000040/      model.pt  optimizer.pt  scheduler.pt  rng.pt  manifest.json   (1 and 2)
    checkpoints/.step-00000080.tmp-<pid>/   a save in progress (ignored, removed by the next save)

Format 3 (``start_save``, the local engine's default) is torch.distributed.checkpoint written in the background
(nam_core/engine/async_checkpoint.py): training pays only the copy of the state to host memory. Formats 1 and 2
(``save``, one torch.save file per part on the training thread; ``train.async_checkpoints=false``) still load.

A checkpoint is *good* when its folder has its final name and its manifest's sha256 of every file matches.
Rename is atomic on POSIX, so a crash or ``kill -9`` mid-save leaves only a ``.tmp`` folder behind and
never damages the last good checkpoint. Old checkpoints are deleted only after a new one is in place, and
renamed aside (``.step-*.old-<pid>``) before they are deleted, so a kill mid-delete never leaves a half
folder under a good name. A full disk is an error that says so (RunFolderError, exit 6) and removes the
half-written save.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from nam_core.data.dataset import file_sha256
from nam_core.data.integrity import Abandoned
from nam_core.engine import rundir
from nam_core.errors import ConfigError, NamError, RunFolderError
from nam_core.files import fsync_dir

FILES = ("model.pt", "optimizer.pt", "scheduler.pt", "rng.pt")
FORMAT = 2  # 2: rng.pt holds tensors and plain numbers only (1: numpy's pickled state)




def rng_state() -> dict:
    """Every generator's state as tensors and plain numbers, so a checkpoint loads with ``weights_only=True``
    (numpy's own state holds an ndarray, which only a full unpickler rebuilds)."""
    version, mt, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64),  # [625] uint32 words
                        "gauss_next": gauss_next},
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),  # [624] uint32 words
                       "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, *, source: Path | str = "rng state") -> None:
    """Restore what ``rng_state`` saved; a state of another shape is a RunFolderError naming ``source``."""
    try:
        python, numpy_state = state["python"], state["numpy"]
        if isinstance(python, dict):
            mt = tuple(int(w) for w in python["mt"].tolist())
            python = (int(python["version"]), mt, python["gauss_next"])
            keys = numpy_state["keys"].numpy().astype(np.uint32)
            numpy_state = (numpy_state["kind"], keys, numpy_state["pos"], numpy_state["has_gauss"],
                           numpy_state["cached_gaussian"])
        torch.set_rng_state(state["torch"])
        random.setstate(python)
        np.random.set_state(numpy_state)
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise RunFolderError(f"{source}: not a random-number state this version of nam wrote ({e!r})",
                             hint="resume from an earlier checkpoint (--resume PATH), or start without --resume") from e
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def load_tensors(path: Path):
    """``torch.load`` that rebuilds only tensors and plain containers: a checkpoint from elsewhere cannot run
    code. A file that needs more (a crafted pickle, or a format-1 ``rng.pt`` with numpy arrays, read by
    ``_load_rng``) is a RunFolderError naming it."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise RunFolderError(
            f"{path}: refused to load, it asks for more than tensors and plain values ({_globals_named(path)})",
            hint="a nam checkpoint never does: this file was written by something else or altered; resume from "
                 "another checkpoint or start without --resume") from e


def _globals_named(file) -> str:
    """The Python globals a torch.save file's pickle names (a path or a file object), read without running
    it: for the message."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception as e:  # noqa: BLE001 - only the message's detail; the load was refused either way
        return f"its pickle could not be listed: {type(e).__name__}"
    return "names " + ", ".join(names[:5]) if names else "not a torch.save file"


def _load_rng(path: Path, manifest: dict) -> dict:
    """Format 2 holds tensors only. Format 1 (before 2026-11-25) kept numpy's state as an ndarray: allow
    exactly the numpy globals that rebuild a plain array, still under the restricted unpickler."""
    if manifest.get("format", 1) >= 2:
        return load_tensors(path)
    core = getattr(np, "_core", None) or np.core  # numpy >= 2 renamed np.core to np._core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        return load_tensors(path)


def _fault_injection(step: int) -> None:
    """Tests set NAM_TEST_KILL_DURING_SAVE=N to SIGKILL this process halfway through saving step N."""
    if os.environ.get("NAM_TEST_KILL_DURING_SAVE") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def start_save(ckpt_root: Path, step: int, *, saver, model, optimizer, scheduler, extra: dict, keep: int):
    """Format 3: wait for the save in flight (``finish_save``), then copy the state to host memory on this thread
    and write checkpoint ``step`` in the background; returns its ``PendingSave`` (async_checkpoint.py). The folder
    gets its final name, hashed and with its manifest, when the write is done; until then it is hidden."""
    from nam_core.engine import async_checkpoint as dcp

    finish_save(saver, ckpt_root, model, optimizer)
    tmp, final = _aside(ckpt_root, step)
    state = _save_state(model, optimizer, scheduler)

    def finish(tmp: Path, final: Path) -> None:  # the background thread, after the files are written
        names = dcp.state_files(tmp)
        hashed = hash_files([tmp / name for name in names])  # the new files: not in the cache yet
        digests = {name: hashed[tmp / name] for name in names}
        dcp.write_manifest(tmp, {"format": dcp.FORMAT, "step": step, **extra, "sha256": digests})
        _into_place(tmp, final, ckpt_root, keep)

    try:
        tmp.mkdir()
        return saver.start(tmp, final, step, state, finish)
    except BaseException as exc:
        _save_failed(ckpt_root, tmp, exc, model, optimizer)
        raise


def prepare_save(saver, *, model, optimizer, scheduler):
    """Format 3: start building the host buffers of ``saver`` for this run's state on a background thread
    (``AsyncSaver.prepare``), so the first ``start_save`` finds them ready; returns their ``HostBuffers``. Call it
    once the optimizer has its state (after the first step): its shapes are what the buffers mirror."""
    return saver.prepare(_save_state(model, optimizer, scheduler))


def _save_state(model, optimizer, scheduler) -> dict:
    """What a format-3 checkpoint holds: the dict DCP saves (its tensors are the live ones: references)."""
    from nam_core.engine import async_checkpoint as dcp

    model_sd, optim_sd = dcp.state_dicts(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd, "scheduler": scheduler.state_dict(), "rng": rng_state()}


def finish_save(saver, ckpt_root: Path, model, optimizer) -> Path | None:
    """The folder of the save in flight once it is on disk (None when there is none); a full disk during its
    background write is the RunFolderError ``save`` raises (its half-written folder is already removed)."""
    try:
        return saver.wait()
    except BaseException as exc:
        if rundir.disk_full(exc):
            raise _no_space(ckpt_root, model, optimizer) from exc
        raise


def _into_place(tmp: Path, final: Path, ckpt_root: Path, keep: int) -> None:
    """Rename a finished save into place (the same step saved again replaces it), then prune to ``keep``."""
    _rename_in(tmp, final, ckpt_root)
    for old in pruned(good_checkpoints(ckpt_root), final, keep):
        _remove(old)


def pruned(good: list[Path], final: Path, keep: int) -> list[Path]:
    """What a save of ``final`` deletes from ``good`` (oldest first) to keep ``keep``: the oldest of the
    checkpoints of earlier steps, so ``final`` and the ``keep - 1`` before it stay. ``final`` is never deleted,
    nor is a checkpoint of a later step: after a resume from an earlier step, the later ones are another
    branch's (``--resume auto`` follows the branch that saved last, nam_core/engine/rundir.py), and counting them
    deleted the save just written when they were ``keep`` or more. Both engines prune with it."""
    older = [p for p in good if p.name < final.name]
    return older[:max(0, len(older) - (keep - 1))]


def _rename_in(tmp: Path, final: Path, ckpt_root: Path) -> None:
    """Rename a finished save's hidden folder to ``final``. A folder already there (the same step saved again,
    e.g. at the end of a resumed run) is renamed aside first and deleted after: a kill at any point leaves a good
    ``final`` (old or new) and at most a hidden leftover. Both engines' saves end here."""
    replaced = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.rename(final, replaced)
    os.rename(tmp, final)
    fsync_dir(ckpt_root)
    shutil.rmtree(replaced, ignore_errors=True)


def save(ckpt_root: Path, step: int, *, model, optimizer, scheduler, extra: dict, keep: int) -> Path:
    """Write checkpoint ``step`` atomically; return its folder. ``extra`` goes into the manifest."""
    tmp, final = _aside(ckpt_root, step)
    try:
        tmp.mkdir()
        _write(tmp, step, model=model, optimizer=optimizer, scheduler=scheduler, extra=extra)
        _into_place(tmp, final, ckpt_root, keep)
    except BaseException as exc:
        _save_failed(ckpt_root, tmp, exc, model, optimizer)
        raise
    return final


def _aside(ckpt_root: Path, step: int) -> tuple[Path, Path]:
    """``(tmp, final)`` of checkpoint ``step``: the hidden folder it is written into (the caller makes it) and
    the name it gets when done. Hidden folders left in ``ckpt_root`` go first: no save is in flight when one
    starts, so they are leftovers of a killed save or prune, never a good checkpoint."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = ckpt_root / f"step-{step:08d}"
    return ckpt_root / f".{final.name}.tmp-{os.getpid()}", final


def _save_failed(ckpt_root: Path, tmp: Path, exc: BaseException, model, optimizer) -> None:
    """A save that raised ``exc``: its hidden folder removed, and a full disk raised as ``_no_space`` (exit 6,
    what one checkpoint needs); any other error is the caller's to raise again."""
    shutil.rmtree(tmp, ignore_errors=True)
    if rundir.disk_full(exc):
        raise _no_space(ckpt_root, model, optimizer) from exc


def _write(tmp: Path, step: int, *, model, optimizer, scheduler, extra: dict) -> None:
    """Every file of the checkpoint into ``tmp``, on disk. Through our own file objects, so a full disk is
    OSError(ENOSPC) (torch's writer on a path reports "unexpected pos" instead)."""
    _save_file(model.state_dict(), tmp / "model.pt")
    _fault_injection(step)
    _save_file(optimizer.state_dict(), tmp / "optimizer.pt")
    _save_file(scheduler.state_dict(), tmp / "scheduler.pt")
    _save_file(rng_state(), tmp / "rng.pt")
    manifest = {"format": FORMAT, "step": step, **extra,
                "sha256": {name: file_sha256(tmp / name) for name in FILES}}
    with open(tmp / "manifest.json", "w") as f:
        f.write(json.dumps(manifest, indent=2))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


def _save_file(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _remove(folder: Path) -> None:
    """Rename aside, then delete: a kill mid-delete leaves a hidden leftover, never a damaged ``step-*``."""
    aside = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    os.rename(folder, aside)
    shutil.rmtree(aside)


def _state_bytes(state) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_state_bytes(v) for v in state)
    return 0


def _no_space(ckpt_root: Path, model, optimizer) -> RunFolderError:
    return no_space(ckpt_root, (_state_bytes(model.state_dict()) + _state_bytes(optimizer.state_dict())) / 2**20,
                    good_checkpoints(ckpt_root))


def no_space(ckpt_root: Path, need_mb: float | None, good: list[Path], *, started: bool = True) -> RunFolderError:
    """The error of a save that filled its disk (either engine), or of one not started because it would
    (``started=False``): the disk, what one checkpoint needs, what is free now that the half-written save is
    gone, and the checkpoint a resume takes."""
    free = rundir.free_mb(ckpt_root)
    sizes = ", ".join(x for x in (f"a checkpoint needs about {need_mb:.0f} MB" if need_mb is not None else "",
                                  f"{free:.0f} MB free" if free is not None else "") if x)
    keep = f"the newest good checkpoint, {good[-1].name}, is intact" if good else "no checkpoint was saved yet"
    return RunFolderError(
        f"no space left on {ckpt_root} (disk {rundir.mount_point(ckpt_root)}{': ' + sizes if sizes else ''}); "
        f"{'the half-written save was removed' if started else 'the save was not started'} and {keep}",
        hint=f"free space on that disk (or lower train.keep_checkpoints), then continue with --resume auto "
             f"--run-dir {ckpt_root.parent}")


def _dcp_format(manifest: dict) -> bool:
    """Whether a manifest is format 3's (async_checkpoint.py); another engine's string format is not."""
    fmt = manifest.get("format", 1)
    return isinstance(fmt, int) and fmt >= 3


_DIGESTS: dict[tuple, str] = {}
"""sha256 by file version (``file_version``): one start verifies the same checkpoints up to three
times (the run folder's plan, ``--resume auto``, the engine's start) and a background save prunes right after
hashing what it wrote; at full NAM56R each pass over a checkpoint is 27 GB of hashing."""


def file_version(st) -> tuple[int, int, int, int, int]:
    """What tells one version of a file from another (``os.stat_result``): device, inode, size, and the times of
    its last write (mtime) and last change (ctime, in ns). mtime alone can be set back (``os.utime``, ``cp -p``,
    ``rsync -t``) after a same-size rewrite in place; ctime cannot be set from user space."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class _Hashing:
    """A file version being hashed by one thread (``_sha256``): the others wait for its ``digest`` or ``error``."""

    def __init__(self):
        self.done = threading.Event()
        self.digest: str | None = None
        self.error: BaseException | None = None
        self.waiters = 0  # threads waiting for it (the tests watch it to know the overlap happened)


_HASHING: dict[tuple, _Hashing] = {}
_DIGESTS_LOCK = threading.Lock()  # guards _DIGESTS and _HASHING
_LOCAL = threading.local()  # .stop: the Event of the VerifyAhead this thread hashes for (None: a caller's own)


def _sha256(path: Path, stop: threading.Event | None = None) -> str:
    """``file_sha256(path)``, once per file version in this process (a save's own files are hashed here too,
    so its pruning and the next start's check find them).

    Single-flight: a version another thread is hashing is waited for, not read again; its OSError (any
    Exception) reaches every waiter as it would a single caller, and is not kept, so a later call hashes again.
    ``stop`` (default: this thread's, set by ``VerifyAhead``): once set, a hash not yet begun or still under way
    gives up with ``integrity.Abandoned``; a thread that was waiting for it then hashes the file itself."""
    stop = stop if stop is not None else getattr(_LOCAL, "stop", None)
    key = file_version(path.stat())
    while True:
        with _DIGESTS_LOCK:
            if key in _DIGESTS:
                return _DIGESTS[key]
            hashing = _HASHING.get(key)
            if hashing is None:
                if stop is not None and stop.is_set():
                    raise Abandoned(f"{path}: hash given up")
                hashing = _HASHING[key] = _Hashing()
                break
            hashing.waiters += 1
        hashing.done.wait()
        with _DIGESTS_LOCK:
            hashing.waiters -= 1
        if hashing.digest is not None:
            return hashing.digest
        if isinstance(hashing.error, Exception) and not isinstance(hashing.error, Abandoned):
            raise hashing.error
        # given up (Abandoned), or the hashing thread was interrupted (KeyboardInterrupt): hash it here
    try:
        hashing.digest = file_sha256(path, stop=stop)
    except BaseException as exc:
        hashing.error = exc
        raise
    finally:
        with _DIGESTS_LOCK:
            if hashing.digest is not None:
                _DIGESTS[key] = hashing.digest
            del _HASHING[key]
        hashing.done.set()
    return hashing.digest


def known_digests(paths) -> dict[tuple, str]:
    """The digests this process holds for ``paths``' current versions, by ``file_version``: what one rank hands
    the others so that a run's checkpoints are hashed once per host, not once per rank (``adopt_digests``)."""
    out = {}
    with _DIGESTS_LOCK:
        for path in paths:
            try:
                key = file_version(Path(path).stat())
            except OSError:
                continue  # gone: the receiving rank's own check meets that
            if key in _DIGESTS:
                out[key] = _DIGESTS[key]
    return out


def adopt_digests(digests: dict[tuple, str]) -> int:
    """Take digests another rank of this run computed (``known_digests``) into this process's cache. A digest
    is used only for a file whose version (device, inode, size, mtime, ctime) is the one it was computed for,
    so a rank on another host, or a file changed since, is hashed here again. Returns how many were taken."""
    with _DIGESTS_LOCK:
        for key, digest in digests.items():
            _DIGESTS.setdefault(tuple(key), digest)
    return len(digests)


HASH_THREADS = 8
"""Files hashed at once (``hash_files``): sha256 is sequential within a file, so a checkpoint is written as
several files (async_checkpoint.FILES) and they are hashed side by side; hashlib and file reads release the GIL.
8: enough for one NVMe disk's read rate (~2 GB/s of sha256 per core); our GPU host has 16 cores."""


def hash_files(paths: list[Path], *, threads: int = HASH_THREADS) -> dict[Path, str]:
    """``{path: sha256}`` of files, ``threads`` at once, each once per file version in this process (``_sha256``).
    An unreadable file raises its OSError, as hashing it alone would. Called by a ``VerifyAhead`` thread, its
    helper threads give up with it."""
    from concurrent.futures import ThreadPoolExecutor

    stop = getattr(_LOCAL, "stop", None)
    if threads <= 1 or len(paths) <= 1:
        return {path: _sha256(path, stop) for path in paths}
    prefix = "nam-verify-sha256" if stop is not None else "nam-sha256"
    with ThreadPoolExecutor(min(threads, len(paths)), thread_name_prefix=prefix) as pool:
        return dict(zip(paths, pool.map(lambda path: _sha256(path, stop), paths)))


class VerifyAhead:
    """An engine's ``check_ahead(ckpt_root)`` (this rank's part of its ``good_checkpoints``, without the ranks'
    exchange) run early, on a daemon thread named ``nam-verify``, so that the sha256 of a resume's checkpoints
    (~53 GB at full NAM56R, ~7 s) overlaps the plugins' self-tests instead of following them (``nam train
    --resume``). Its answer is dropped: what it leaves is the digests in this process's cache (``_sha256``),
    which the run folder's own check (``RunFolder.claim``, the engine's ``good_checkpoints``) then reads, waiting
    for a file still being hashed rather than reading it twice. So the check decides exactly as it would alone,
    and meets the same errors at the same place: the background pass keeps an error (``error``) and prints nothing,
    and the error is not cached, so the foreground's call hashes that file again and raises it.

    ``stop()`` (``nam train``: right after the claim, which leaves it nothing to hash since it needed every digest
    this pass makes, and on every exit): set the stop event, so that a hash under way gives up at its next 8 MiB
    block and those not begun never start, then join the thread (``STOP_WAIT_S`` at most): a failing start exits
    at once instead of hashing the rest.

    It verifies the checkpoints in the engine's own order, not the newest first: the claim checks every one of
    them (``rundir.Contents``) before it picks one, so the order does not change when the claim can go on."""

    STOP_WAIT_S = 10.0
    """How long ``stop`` waits for the thread: a hash gives up within one block (~10 ms of reading); only a read
    stuck in the kernel (a dead network disk) outlasts it. The daemon thread is then left behind; its helper
    threads (``hash_files``'s pool) are not daemons, so such a read holds up the exit as the claim's own would."""

    def __init__(self, check: Callable[[Path], object], ckpt_root: Path):
        self._stop = threading.Event()
        self.error: Exception | None = None
        """What the background pass raised (kept, never printed: the foreground's own call meets it again)."""
        self.seconds: float | None = None
        """How long the background pass took, once it has ended (for the run log's note)."""
        self._thread = threading.Thread(target=self._run, args=(check, ckpt_root), name="nam-verify", daemon=True)
        self._thread.start()

    def _run(self, check: Callable[[Path], object], ckpt_root: Path) -> None:
        _LOCAL.stop = self._stop
        began = time.monotonic()
        try:
            check(ckpt_root)
        except Abandoned:
            pass  # stopped: nobody wants the rest
        except Exception as exc:  # noqa: BLE001 - not lost: the foreground's call hashes again and raises it
            self.error = exc
        self.seconds = time.monotonic() - began

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.STOP_WAIT_S)


def verify(folder: Path) -> dict | None:
    """The manifest of a good checkpoint folder, or None if it is incomplete or corrupt."""
    return inspect(folder)[0]


def read_manifest(folder: Path) -> tuple[dict | None, str]:
    """``(manifest, "")`` as a checkpoint folder's manifest.json holds it (parsed JSON, not yet checked), or
    ``(None, why not)``, ``why`` never empty: a hidden folder, no manifest, or one that is not a JSON object. Both
    engines' ``inspect`` start here; what a manifest must list is each format's own."""
    if folder.name.startswith("."):
        return None, "a save in progress or interrupted (hidden folder)"
    path = folder / "manifest.json"
    if not path.is_file():
        return None, "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"manifest.json is not valid JSON ({e})"
    if not isinstance(manifest, dict):
        return None, f"manifest.json holds a JSON {type(manifest).__name__}, not an object"
    return manifest, ""


def inspect(folder: Path) -> tuple[dict | None, str]:
    """``(manifest, "")`` for a good checkpoint folder, ``(None, what is wrong with it)`` otherwise."""
    manifest, why = read_manifest(folder)
    if why:
        return None, why
    digests = manifest.get("sha256", {})
    names = _checked_files(folder, manifest)
    if _dcp_format(manifest):
        from nam_core.engine.async_checkpoint import STATE

        if f"{STATE}/.metadata" not in names or set(names) != set(digests):
            return None, (f"the files under {STATE}/ ({', '.join(names) or 'none'}) are not the ones its manifest "
                          f"lists ({', '.join(sorted(digests))})")
    for name in names:
        if not (folder / name).is_file():
            return None, f"{name} is missing"
    hash_files([folder / name for name in names])  # side by side; the checks below read the cache
    for name in names:
        if digests.get(name) != _sha256(folder / name):
            return None, f"sha256 mismatch of {name} (the file changed after it was saved)"
    return manifest, ""


def _checked_files(folder: Path, manifest: dict) -> list[str]:
    """The files ``inspect`` hashes: format 3's under ``state/`` as found, or formats 1 and 2's fixed names."""
    if _dcp_format(manifest):
        from nam_core.engine.async_checkpoint import state_files

        return state_files(folder)
    return list(FILES)


def good_checkpoints(ckpt_root: Path) -> list[Path]:
    """Good checkpoint folders, oldest first."""
    if not ckpt_root.is_dir():
        return []
    folders = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    listed = [f / name for f in folders if (m := read_manifest(f)[0]) is not None for name in _checked_files(f, m)]
    hash_files([path for path in listed if path.is_file()])  # every folder's files side by side, then checked
    return [p for p in folders if verify(p) is not None]


def resolve_resume(spec: str, ckpt_root: Path, *, good: Callable[[Path], list[Path]] = good_checkpoints,
                   is_good: Callable[[Path], bool] = lambda folder: verify(folder) is not None,
                   what: str = "checkpoint", why_not: str = "missing files or sha256 mismatch",
                   why: Callable[[Path], str] | None = None, warn: Callable[[str], None] | None = None) -> Path:
    """``auto`` -> newest good checkpoint under ``ckpt_root``; a path -> that checkpoint, verified.

    ``warn(line)`` hears of each newer checkpoint folder ``auto`` skips, and why (``why(folder)``; this
    engine's format by default). ``good``/``is_good``/``what``/``why_not``: another engine's checkpoint
    format (the megatron engine's)."""
    if why is None:
        why = (lambda folder: inspect(folder)[1]) if good is good_checkpoints else (lambda folder: why_not)
    if spec == "auto":
        found = good(ckpt_root)
        newest = found[-1] if found else None
        skipped = [p for p in _step_folders(ckpt_root) if newest is None or p.name > newest.name]
        if newest is None:
            damaged = "".join(f"; {p.name}: {why(p)}" for p in skipped)
            start_over = (f"remove the damaged ones (rm -r {ckpt_root}) to start afresh" if skipped else
                          "start without --resume")
            raise RunFolderError(f"--resume auto: no good {what} under {ckpt_root}{damaged}",
                                 hint=f"{start_over}, or point --resume at a good checkpoint folder")
        for folder in skipped:
            if warn is not None:
                warn(f"skipped checkpoint {folder}: {why(folder)}; resuming from {newest.name}")
        return newest
    folder = Path(spec)
    if not folder.is_dir():  # a mistyped path: a usage error (exit 2)
        raise ConfigError(f"--resume {spec}: no such folder",
                          hint=f"use --resume auto to take the newest good checkpoint under {ckpt_root}")
    if not is_good(folder):  # a truncated or damaged checkpoint: the folder cannot be used (exit 6)
        raise RunFolderError(f"--resume {spec}: not a complete {what} ({why(folder)})",
                             hint=f"use --resume auto to take the newest good checkpoint under {ckpt_root}")
    return folder


def _step_folders(ckpt_root: Path) -> list[Path]:
    return sorted(p for p in ckpt_root.glob("step-*") if p.is_dir()) if ckpt_root.is_dir() else []


def load(folder: Path, *, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG from a verified folder; return its manifest."""
    manifest = verify(folder)
    if manifest is None:
        raise NamError(f"checkpoint {folder} failed verification", hint="use --resume auto")
    if _dcp_format(manifest):
        from nam_core.engine import async_checkpoint as dcp

        rng = dcp.load(folder, model=model, optimizer=optimizer, scheduler=scheduler, rng_template=rng_state())
        set_rng_state(rng, source=folder / "state")
        return manifest
    model.load_state_dict(load_tensors(folder / "model.pt"))
    optimizer.load_state_dict(load_tensors(folder / "optimizer.pt"))
    scheduler.load_state_dict(load_tensors(folder / "scheduler.pt"))
    set_rng_state(_load_rng(folder / "rng.pt", manifest), source=folder / "rng.pt")
    return manifest


def model_state(folder: Path) -> tuple[dict, dict]:
    """The model's state dict (CPU tensors) and the manifest of a verified checkpoint folder, without an
    optimizer or a model to load into (``nam export``)."""
    manifest = verify(folder)
    if manifest is None:
        raise _failed_verification(folder)
    if _dcp_format(manifest):
        from nam_core.engine import async_checkpoint as dcp

        return {k[len("model."):]: v for k, v in dcp.read_flat(folder, "model.").items()}, manifest
    return load_tensors(folder / "model.pt"), manifest


def _failed_verification(folder: Path) -> RunFolderError:
    """A checkpoint asked for by path that is torn or altered: exit 6, as a resume from it is, with the folder
    whose good checkpoints to choose from."""
    return RunFolderError(f"checkpoint {folder} failed verification ({inspect(folder)[1]})",
                          hint=f"export a good one: ls {Path(folder).resolve().parent}")


def optimizer_state(folder: Path) -> dict:
    """The optimizer's state dict of a verified checkpoint folder (``{"state": {index: {"step", "exp_avg",
    "exp_avg_sq"}}, ...}``, with the fp32 masters under ``numerics.MASTER_KEY`` when it has them), CPU tensors,
    without an optimizer to load into (``nam export --with-optimizer``)."""
    manifest = verify(folder)
    if manifest is None:
        raise _failed_verification(folder)
    if not _dcp_format(manifest):
        return load_tensors(folder / "optimizer.pt")
    from nam_core.engine import async_checkpoint as dcp
    from nam_core.engine.numerics import MASTER_KEY

    flat = dcp.read_flat(folder, "optimizer.")
    state: dict = {}
    masters: dict[int, torch.Tensor] = {}
    for key, value in flat.items():
        parts = key.split(".")  # optimizer.state.<index>.<name>; optimizer.nam_master_weights.<i> (a list: by item)
        if parts[1] == "state":
            state.setdefault(int(parts[2]), {})[".".join(parts[3:])] = value
        elif parts[1] == MASTER_KEY and len(parts) == 3:
            masters[int(parts[2])] = value
    out = {"state": state}
    if masters:
        out[MASTER_KEY] = [masters[i] for i in range(len(masters))]
    elif isinstance(flat.get(f"optimizer.{MASTER_KEY}"), list):  # an empty list is stored whole
        out[MASTER_KEY] = flat[f"optimizer.{MASTER_KEY}"]
    return out
