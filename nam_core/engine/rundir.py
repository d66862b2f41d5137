"""The run folder: what is in it, who owns it, what a new start does with what it finds, what a resume may
change, a stop on request, and filesystem failures as one-block errors. ``RunFolder`` owns every file:

    runs/<name>/config.json       the run's identity (recipe, model, train, plugins, data): a resume must match it
    runs/<name>/plugins.json      active plugins, backends, patches, versions, device
    runs/<name>/metrics.jsonl     one record per logged step (``metrics.MetricsLog``)
    runs/<name>/run.log           one-off notes (plugin hand-overs, resumes, skipped checkpoints)
    runs/<name>/summary.json      the end-of-run summary
    runs/<name>/checkpoints/      step-<N>/ folders (the engine's format: ``checkpoint.py``, ``megatron/checkpoint.py``)
    runs/<name>/run.lock          held (flock) by the live run; its pid, host and start time, for messages
    runs/<name>/history.jsonl     one line per start: fresh, restart or resume, with the fields it changed
    runs/<name>/stopped-<time>/   what a run that stopped before its first checkpoint left (moved aside)

Every whole-file write goes through ``nam_core.files.write_atomic`` (aside, then rename).

Why flock: the kernel lets go of it when its process dies, however it dies (SIGKILL, the OOM killer), so a
lock never outlives its owner on this machine and a crash never leaves a folder that needs ``rm -rf``. The
file is removed on every exit Python sees; a file still there, with a pid in it, when the lock is free
was left by a process that died holding it: that pid is named in a note and the lock is taken over.
(flock is not reliable on NFS: keep run folders on a local disk.)

Everything here that decides (``plan``) only reads; ``begin`` writes, under the lock, once every check
has passed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from nam_core.errors import ConfigError, Interrupted, RunFolderError
from nam_core.files import write_json_atomic

LOCK = "run.lock"
HISTORY = "history.jsonl"
RUN_FILES = frozenset({"config.json", "plugins.json", "metrics.jsonl", "run.log", "summary.json", HISTORY, LOCK,
                       "tensorboard", "checkpoints"})
"""What nam writes into a run folder; anything else, in a folder with no config.json, is not a run's."""
MOVED_ASIDE = ("config.json", "plugins.json", "metrics.jsonl", "summary.json", "tensorboard")
"""A restarted folder's outputs of the run that stopped (run.log and history.jsonl go on, appended)."""

RESUMABLE = ("train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.total_steps", "train.grad_clip",
             "train.weight_decay", "train.log_every", "train.checkpoint_every", "train.keep_checkpoints",
             "train.eval_every", "train.eval_tokens", "train.async_checkpoints", "train.recompute")
"""Fields a resume may change. They steer the run from the next step on and change no tensor's shape or
meaning: the LR schedule is rebuilt from (step, these fields) at every start, weight decay is set on the
optimizer's groups after a load, activation recompute computes the same step (bit-exact, or to 2e-7 under Megatron's own: nam56r/recompute.py), the
rest are read each step. ``train.optimizer_numerics`` is not among them: it changes what the checkpoint's
optimizer state holds (fp32 masters or not, the moments' dtype). Every other field (shapes, dtype, batch sizes,
seed, data, plugins) changes what the checkpoint's tensors are or which batches come next: refused."""


# --- filesystem failures -------------------------------------------------------------------------------

_WHY = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
        errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
        errno.EROFS: "read-only filesystem", errno.ENOTDIR: "a file stands where a folder should be",
        errno.EISDIR: "a folder stands where a file should be"}
"""OSErrors a person fixes on the filesystem; any other OSError is a bug or a broken disk: a traceback."""


def filesystem_error(exc: OSError, run_dir: Path) -> RunFolderError | None:
    """``exc`` as a one-block error naming the path, or None when it is not one a person can fix."""
    why = _WHY.get(exc.errno)
    if why is None:
        return None
    path = exc.filename or run_dir
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = (f"free space on that disk (or move the run folder to another), then continue the run with "
                f"--resume auto --run-dir {run_dir}: its newest good checkpoint is kept")
    elif exc.errno in (errno.ENOTDIR, errno.EISDIR):
        hint = f"move {path} out of the way, or choose another --run-dir"
    else:
        hint = f"make {path} writable (or use a writable disk), or choose another --run-dir"
    verb = "cannot write to" if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) else "cannot use"
    return RunFolderError(f"{verb} {path}: {why}", hint=hint)


def disk_full(exc: BaseException | None) -> bool:
    """ENOSPC or EDQUOT anywhere in ``exc``'s chain. On a real filesystem torch's checkpoint writer meets the
    OSError, then fails again closing its archive ("unexpected pos ..."): the OSError is that error's context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (the disk a "no space" message names)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def free_mb(path: Path) -> float | None:
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return None


@contextmanager
def readable_filesystem_errors(run_dir: Path) -> Iterator[None]:
    """Turn the OSErrors of ``filesystem_error`` raised inside into RunFolderError (exit 6)."""
    try:
        yield
    except OSError as exc:
        readable = filesystem_error(exc, run_dir)
        if readable is None:
            raise
        raise readable from exc


def check_usable(run_dir: Path) -> None:
    """Before anything is written: a file where the run folder (or its checkpoints/) should be, or a folder
    this process cannot write, is refused here instead of failing halfway through a start."""
    for path in (run_dir, run_dir / "checkpoints"):
        if path.is_symlink() and not path.exists():  # exists() follows the link: a dangling or looping one
            raise RunFolderError(f"{path} is a symbolic link to {os.readlink(path)}, which "
                                 f"{'loops' if _loops(path) else 'does not exist'}",
                                 hint=f"remove the link (rm {path}) or point it at a folder, or choose another "
                                      "--run-dir")
        if path.exists() and not path.is_dir():
            raise RunFolderError(f"{path} is a file; the run needs a folder there",
                                 hint=f"move {path} out of the way, or choose another --run-dir")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunFolderError(f"cannot create the run folder {run_dir}: {existing} is a file",
                             hint=f"move {existing} out of the way, or choose another --run-dir")
    for path in (existing, run_dir / "checkpoints"):
        if path.is_dir():
            _check_writable(path)


def _loops(path: Path) -> bool:
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python 3.11: "Symlink loop"
        return True
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


READ_ONLY, DENIED = "read-only filesystem", "permission denied"


def unwritable(folder: Path) -> str | None:
    """Why no file can be made in the existing ``folder`` (``READ_ONLY``, ``DENIED``), or None: asked before a
    run folder or a dataset folder (``nam data prepare``) is written, each wording its own refusal."""
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return READ_ONLY
    if not os.access(folder, os.W_OK | os.X_OK):
        return DENIED
    return None


def _check_writable(path: Path) -> None:
    why = unwritable(path)
    if why is not None:
        raise RunFolderError(f"cannot write to {path}: {why}",
                             hint="choose a --run-dir on a writable disk" if why == READ_ONLY else
                             f"make it writable (chmod u+w {path}), or choose another --run-dir")


# --- the lock --------------------------------------------------------------------------------------------

def _owner_text() -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def describe_owner(text: str) -> tuple[str, int | None]:
    """``("pid 123 on host, started ...", 123)`` from a lock file's text (or what is known of it)."""
    try:
        owner = json.loads(text)
        return f"pid {owner['pid']} on {owner['host']}, started {owner['started']}", int(owner["pid"])
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet (it is starting)", None


class RunFolder:
    """The run folder and every file in it. Held for the run's life by the process that writes it: created if
    needed, locked, and given back on any exit (``with RunFolder(path) as folder:``); ``stale`` names the
    previous owner when it died holding the lock. Unlocked, it is a view that reads (and lets an engine's
    ranks find where metrics and checkpoints go)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock_path = self.path / LOCK
        self.stale: str | None = None
        self._fd: int | None = None
        self._created: list[Path] = []

    # --- the files ---

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def config(self) -> dict | None:
        """The recorded identity (config.json), or None when there is none or it is not JSON."""
        return _read_json(self.path / "config.json")

    def write_config(self, record: dict) -> None:
        write_json_atomic(self.path / "config.json", record)

    def write_plugins(self, info: dict) -> None:
        write_json_atomic(self.path / "plugins.json", info)

    def write_summary(self, summary: dict) -> None:
        write_json_atomic(self.path / "summary.json", summary)

    def metrics(self) -> list[dict]:
        from nam_core.engine.metrics import read_metrics

        return read_metrics(self.path)

    def metrics_log(self, *, start_step: int, total_steps: int, quiet: bool):
        """The log an engine writes metrics.jsonl and run.log through (rank 0)."""
        from nam_core.engine.metrics import MetricsLog

        self.path.mkdir(parents=True, exist_ok=True)
        return MetricsLog(self.path, start_step=start_step, total_steps=total_steps, quiet=quiet)

    def truncate_metrics(self, last_step: int) -> list[str]:
        """Drop metrics after ``last_step`` (a resume makes them again); what was cut, as notes."""
        from nam_core.engine.metrics import truncate_metrics

        return truncate_metrics(self.path, last_step)

    def claim(self, record: dict, resume: str | None, *, good, resolve, again, max_steps: int | None = None) -> "Start":
        """How this run starts here (``plan``), with a note of a stale lock taken over. Call under the lock."""
        start = plan(self.path, record, resume, good=good, resolve=resolve, again=again, max_steps=max_steps)
        if self.stale:
            start.notes.insert(0, self.stale)
        return start

    def begin(self, start: "Start", record: dict, plugins: dict) -> None:
        """Under the lock, after every check: the start's history line, then the run's identity files."""
        begin(self.path, start)
        self.write_config(record)
        self.write_plugins(plugins)

    # --- the lock ---

    def __enter__(self) -> "RunFolder":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        with readable_filesystem_errors(self.path):
            self._make_folders()
            try:
                self._lock()
            except BaseException:
                self.release()
                raise

    def _make_folders(self) -> None:
        missing = []
        path = self.path
        while not path.exists():
            missing.append(path)
            path = path.parent
        for path in reversed(missing):
            path.mkdir(exist_ok=True)
            self._created.append(path)

    def _lock(self) -> None:
        """flock the lock file; retry when the file was replaced between open and flock (its previous owner
        removed it as it let go: our flock is then on a file nobody else will look at)."""
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner, pid = self._read_owner(fd)
                os.close(fd)
                raise RunFolderError(
                    f"run folder {self.path} is in use by another run: {owner}",
                    hint=f"wait for it to end, or stop it with kill -INT {pid or '<its pid>'} (it saves a checkpoint "
                         "first), then continue it with --resume auto; or choose another --run-dir") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        previous = os.pread(fd, 4096, 0).decode(errors="replace")
        if previous.strip():
            self.stale = (f"took over {self.lock_path} from {describe_owner(previous)[0]}: that process ended "
                          f"without letting go of it (killed?) and holds it no longer")
        text = _owner_text().encode()
        os.pwrite(fd, text, 0)  # then cut to length: no moment at which the file is empty
        os.ftruncate(fd, len(text))

    @staticmethod
    def _read_owner(fd: int, wait: float = 2.0) -> tuple[str, int | None]:
        """The holder's description; a holder that has the flock but has not written its pid yet (it took
        the lock a moment ago) is given up to ``wait`` seconds to write it, so the refusal can name it."""
        deadline = time.monotonic() + wait
        while True:
            owner, pid = describe_owner(os.pread(fd, 4096, 0).decode(errors="replace"))
            if pid is not None or time.monotonic() >= deadline:
                return owner, pid
            time.sleep(0.01)

    def release(self) -> None:
        """Remove the lock file (while still holding it), let go, and remove folders this start created
        that are still empty (a start refused after the lock leaves nothing behind)."""
        if self._fd is not None:
            try:
                if os.fstat(self._fd).st_ino == os.stat(self.lock_path).st_ino:
                    os.unlink(self.lock_path)
            except OSError:
                pass  # a read-only or vanished folder: the kernel still lets go of the flock below
            os.close(self._fd)
            self._fd = None
        for path in reversed(self._created):
            try:
                path.rmdir()
            except OSError:
                break  # not empty: the run wrote into it
        self._created = []


# --- what a start does with what it finds ---------------------------------------------------------------

def record_diff(old: dict, new: dict, prefix: str = "") -> list[tuple[str, object, object]]:
    """``(dotted key, old value, new value)`` for every leaf that differs, compared as JSON."""
    old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changed += record_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            changed.append((f"{prefix}{key}", a, b))
    return changed


def _listed(diffs: list[tuple[str, object, object]]) -> str:
    lines = [f"{k}: {a!r} -> {b!r}" for k, a, b in diffs]
    return "; ".join(lines[:5]) + (" ..." if len(lines) > 5 else "")


def _short(value) -> str:
    """A recorded value for a one-line difference: a sha256 cut to its first 12 characters."""
    text = str(value)
    return text if len(text) <= 12 else text[:12] + "..."


def split_changes(old: dict, new: dict) -> tuple[dict, list[tuple[str, object, object]]]:
    """The differences between two run records: ``({field: [old, new]} a resume may make, the others)``.
    ``branch`` is where a start sits in the run's lineage, not what the run is; ``dataset`` (the data's
    checksums) is compared only when the old record has it (runs recorded before 2026-11-25 do not), and its
    validation split and ``world_size`` (the processes) only when the old record has them (runs recorded before
    2026-12-08 do not)."""
    allowed, refused = {}, []
    split_recorded = "validation_documents" in (old.get("dataset") or {})
    for key, a, b in record_diff(old, new):
        if key == "branch" or (key.startswith("dataset") and "dataset" not in old):
            continue
        if key == "world_size" and "world_size" not in old:  # recorded since 2026-12-08
            continue
        if key == "dataset.validation_documents" and not split_recorded:
            continue
        if key in RESUMABLE:
            allowed[key] = [a, b]
        else:
            refused.append((key, a, b))
    return allowed, refused


@dataclass
class Contents:
    """What a run folder holds, read without writing (the run.lock file aside)."""

    names: set[str]
    config: dict | None
    steps: list[Path]
    """``checkpoints/step-*`` folders, good or not."""
    good: list[Path]

    @classmethod
    def read(cls, run_dir: Path, good: Callable[[Path], list[Path]]) -> "Contents":
        names = {p.name for p in run_dir.iterdir()} - {LOCK} if run_dir.is_dir() else set()
        config = _read_json(run_dir / "config.json") if "config.json" in names else None
        ckpts = run_dir / "checkpoints"
        steps = sorted(p for p in ckpts.glob("step-*") if p.is_dir()) if ckpts.is_dir() else []
        return cls(names, config, steps, good(ckpts) if steps else [])

    @property
    def foreign(self) -> list[str]:
        return sorted(n for n in self.names if n not in RUN_FILES and not n.startswith("stopped-"))


@dataclass
class Start:
    """How this run begins in its folder, decided under the lock before anything is written."""

    kind: str
    """``fresh`` (an empty folder), ``restart`` (a run that stopped before its first checkpoint), ``resume``."""
    resume_from: Path | None = None
    step: int = 0
    changes: dict = field(default_factory=dict)
    """``{"train.lr": [old, new]}``: what this resume changes against the checkpoint's record."""
    notes: list[str] = field(default_factory=list)
    """Lines for the run log and the terminal (``warning: ...`` ones are shown even under --quiet)."""
    aside: Path | None = None
    """Where a restart moves the stopped run's outputs (``stopped-<time>``)."""
    branch: str = ""
    """This start's line of checkpoints (recorded in history.jsonl, the config and every checkpoint's record):
    a fresh start or a resume from a checkpoint that is not its line's newest opens a new one; ``--resume auto``
    takes the newest checkpoint of the line the last start was on."""


def plan(run_dir: Path, record: dict, resume: str | None, *, good: Callable[[Path], list[Path]],
         resolve: Callable[..., Path], again: Callable[..., str], max_steps: int | None = None) -> Start:
    """Decide how to start: refuse (ConfigError, exit 2) a folder of another run, a checkpoint of another
    config, damaged checkpoints alone, or a resume with no step left to train; start afresh in a folder whose
    run never saved a checkpoint.

    ``good(ckpt_root)``/``resolve(spec, ckpt_root, warn=)``: the engine's checkpoint format. ``again(resume=,
    sets=, max_steps=)``: this command again (for hints). ``max_steps``: the step this run stops at
    (``--max-steps``; ``train.total_steps`` of ``record`` when None)."""
    contents = Contents.read(run_dir, good)
    max_steps = max_steps if max_steps is not None else record["train"]["total_steps"]
    if resume is None or (resume == "auto" and not contents.steps):
        return _plan_new(run_dir, contents, resume, record, again, max_steps)
    start = _plan_resume(run_dir, contents, record, resume, resolve)
    if start.step >= max_steps:
        raise ConfigError(
            f"--resume {resume}: checkpoint {start.resume_from} is at step {start.step} and this run stops at step "
            f"{max_steps} (--max-steps is the step to stop at, counted from the run's start): nothing to train",
            hint=": ".join(continue_command(again, step=start.step, total_steps=record["train"]["total_steps"],
                                            max_steps=max_steps)))
    return start


def continue_command(again: Callable[..., str], *, step: int, total_steps: int, max_steps: int) -> tuple[str, str]:
    """What trains on from a checkpoint at ``step``: ``(what it does, the command)``.

    ``--max-steps`` is absolute (the step to stop at), so the command names a later step: the one this command
    asked for when it lies ahead, else ``step`` plus as many steps again, at most ``total_steps`` (then without
    ``--max-steps``). A run at the end of its LR schedule (``train.total_steps``) goes on only with a longer
    schedule, which a resume may set: the command doubles it."""
    if step < total_steps:
        target = max_steps if max_steps > step else min(total_steps, step + max_steps)
        command = again(resume="auto", max_steps=None if target == total_steps else target)
        return f"continue it to step {target} (--max-steps is the step to stop at, counted from the run's start)", \
            command
    longer = 2 * total_steps
    command = again(resume="auto", sets={"train.total_steps": longer}, max_steps=None)
    return (f"the run reached train.total_steps ({total_steps}), the end of its LR schedule; continue it to step "
            f"{longer} with a schedule that long"), command


def whereabouts(run_dir: Path, last_checkpoint: Path | None, *, steps_run: int, again: Callable[..., str],
                total_steps: int) -> dict:
    """Where a finished run's things are, for ``summary.json`` and the lines after the summary: the newest
    checkpoint, the command that continues from it (as many steps again as this run trained, ``steps_run``),
    the metrics, the run log and TensorBoard's events."""
    found = {"checkpoint": str(last_checkpoint) if last_checkpoint is not None else None,
             "continue_with": None, "continue_what": None,
             "metrics": str(run_dir / "metrics.jsonl"), "run_log": str(run_dir / "run.log"),
             "tensorboard": str(run_dir / "tensorboard") if (run_dir / "tensorboard").is_dir() else None}
    if last_checkpoint is not None:
        step = _checkpoint_step(last_checkpoint)
        found["continue_what"], found["continue_with"] = continue_command(
            again, step=step, total_steps=total_steps, max_steps=min(total_steps, step + max(1, steps_run)))
    return found


def _checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder: its manifest's, else its name's (``step-00000010``)."""
    step = _manifest(folder).get("step")
    return int(step) if step is not None else int(folder.name.rsplit("-", 1)[-1])


def _plan_new(run_dir: Path, contents: Contents, resume: str | None, record: dict, again: Callable[..., str],
              max_steps: int) -> Start:
    auto = (f"--resume auto: run folder {run_dir} holds no checkpoint yet, so this run starts afresh"
            if resume == "auto" else None)
    if not contents.names - {HISTORY, "run.log"}:
        return Start("fresh", notes=[auto] if auto else [], branch=new_branch())
    if contents.good:
        newest = contents.good[-1]
        go_on = continue_command(again, step=_checkpoint_step(newest), total_steps=record["train"]["total_steps"],
                                 max_steps=max_steps)
        raise ConfigError(f"run folder {run_dir} already holds a run (newest checkpoint: {newest.name})",
                          hint=f"{': '.join(go_on)}; or choose another --run-dir")
    if contents.steps:
        raise ConfigError(f"run folder {run_dir} holds only damaged checkpoints: "
                          + ", ".join(p.name for p in contents.steps),
                          hint=f"see why with --resume auto; remove them (rm -r {run_dir}/checkpoints) to start "
                               "afresh, or choose another --run-dir")
    if "config.json" not in contents.names and contents.foreign:
        raise ConfigError(f"run folder {run_dir} is not empty and holds no nam run (no config.json): "
                          + ", ".join(contents.foreign[:5]), hint="choose an empty or new --run-dir")
    moved = [n for n in MOVED_ASIDE if n in contents.names]
    aside = _unused(run_dir / f"stopped-{time.strftime('%Y%m%d-%H%M%S')}")
    what = f"{', '.join(moved)} moved to {aside}/" if moved else "nothing to move aside"
    line = (f"run folder {run_dir} holds no checkpoint and no live run (it stopped before its first save, or "
            f"saved none): starting afresh; {what}; run.log and history.jsonl kept")
    return Start("restart", notes=[auto, line] if auto else [line], aside=aside, branch=new_branch())


def _unused(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... : two restarts in one second keep both stopped runs."""
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _plan_resume(run_dir: Path, contents: Contents, record: dict, resume: str, resolve) -> Start:
    fields = ", ".join(RESUMABLE)
    if contents.config is not None:
        _, refused = split_changes(contents.config, record)
        _refuse_other_data(run_dir, refused, record)
        if refused:
            raise ConfigError(f"--resume: run folder {run_dir} belongs to a different config: {_listed(refused)}",
                              hint=f"resume with the same recipe and overrides (a resume may change {fields}), "
                                   "or start a new --run-dir")
    warnings: list[str] = []
    lineage: list[str] = []
    if resume == "auto":
        folder, branch = _auto_on_branch(run_dir, contents, resolve, warnings, lineage)
    else:
        folder = resolve(resume, run_dir / "checkpoints", warn=warnings.append)
        branch = _branch_for_path(run_dir, contents, folder, lineage)
    manifest = _manifest(folder)
    made_with = manifest.get("record") or contents.config
    changes = {}
    if made_with is not None:
        changes, refused = split_changes(made_with, record)
        _refuse_other_data(run_dir, refused, record)
        if refused:
            raise ConfigError(f"--resume {resume}: checkpoint {folder} was made with a different config: "
                              f"{_listed(refused)}",
                              hint=f"resume with the config it was made with (a resume may change {fields}), "
                                   "or start without --resume")
    step = int(manifest.get("step", 0))
    notes = [f"warning: {w}" for w in warnings] + lineage
    if changes:
        notes.append(f"--resume: from step {step}, " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
                     + f" (recorded in {run_dir / HISTORY})")
    return Start("resume", resume_from=folder, step=step, changes=changes, notes=notes, branch=branch)


# --- lineage: which line of checkpoints a start continues ----------------------------------------------

def new_branch() -> str:
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"


def _history(run_dir: Path) -> list[dict]:
    """history.jsonl's entries (a torn or foreign line is skipped: it names no branch)."""
    entries = []
    try:
        lines = (run_dir / HISTORY).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


def _branch_of(folder: Path) -> str | None:
    record = _manifest(folder).get("record")
    return record.get("branch") if isinstance(record, dict) else None


def _auto_on_branch(run_dir: Path, contents: Contents, resolve, warnings: list, lineage: list) -> tuple[Path, str]:
    """``--resume auto``: the newest good checkpoint of the branch the last start was on; with none saved yet,
    the checkpoint that branch started from. A folder that records no branch (before 2026-11-25): the newest."""
    ckpts = run_dir / "checkpoints"
    skipped: list[str] = []
    newest = resolve("auto", ckpts, warn=skipped.append)  # the newest good one; damaged newer ones named
    history = [e for e in _history(run_dir) if e.get("branch")]
    current = history[-1]["branch"] if history else None
    ours = [p for p in contents.good if current is not None and _branch_of(p) == current]
    origin = next((Path(e["from"]) for e in history if e["branch"] == current and e.get("from")), None)
    if ours:
        chosen, how = ours[-1], "the newest checkpoint of this run's current branch"
    elif origin is not None and origin.resolve() in [p.resolve() for p in contents.good]:
        chosen, how = origin, "the checkpoint this run's current branch started from (it has saved none since)"
    else:  # no branch recorded (a folder from before 2026-11-25), or nothing of it left: the newest
        warnings.extend(skipped)
        return newest, _branch_of(newest) or current or new_branch()
    warnings.extend(w.replace(f"resuming from {newest.name}", f"resuming from {chosen.name}") for w in skipped)
    if chosen.resolve() == newest.resolve():
        return newest, current
    folder = resolve(str(chosen), ckpts, warn=warnings.append)
    others = [p.name for p in contents.good if p.name > chosen.name and _branch_of(p) != current]
    started = next(e for e in history if e["branch"] == current)
    lineage.append(f"--resume auto: {chosen.name}, {how} (branch {current}, started {started.get('time')})"
                   + (f"; newer {', '.join(others)} belong to another branch" if others else ""))
    return folder, current


def _branch_for_path(run_dir: Path, contents: Contents, folder: Path, lineage: list) -> str:
    """``--resume PATH``: the branch goes on when PATH is its newest checkpoint, else a new branch starts there."""
    branch = _branch_of(folder)
    mine = [p for p in contents.good if branch is not None and _branch_of(p) == branch]
    if branch is not None and mine and mine[-1].resolve() == folder.resolve():
        return branch
    new = new_branch()
    if contents.good:
        lineage.append(f"--resume {folder}: a new branch ({new}) starts at {folder.name}; --resume auto now "
                       "follows it")
    return new


def _refuse_other_data(run_dir: Path, refused: list, record: dict) -> None:
    """A resume whose dataset's checksums differ from the run's (the data was prepared again under the same
    path, or --data names other data): refused with the files that differ."""
    data = [(k, a, b) for k, a, b in refused if k.startswith("dataset.")]
    if data:
        lines = "; ".join(f"{k.removeprefix('dataset.')}: {_short(a)} -> {_short(b)}" for k, a, b in data[:4])
        raise ConfigError(f"--resume: the data at {record.get('data')} is not the data run folder {run_dir} was "
                          f"trained on ({lines})",
                          hint="resume on the data it was trained on (prepare it again from the same source, or "
                               "point --data at it), or train on the new data in a new --run-dir")


def _manifest(folder: Path) -> dict:
    return _read_json(folder / "manifest.json") or {}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def begin(run_dir: Path, start: Start) -> None:
    """Under the lock, after every check: move a stopped run's outputs aside, drop the leftovers of
    interrupted saves, and append this start to history.jsonl."""
    moved = [n for n in MOVED_ASIDE if (run_dir / n).exists()] if start.aside is not None else []
    if moved:
        start.aside.mkdir()
        for name in moved:
            os.replace(run_dir / name, start.aside / name)
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        import shutil

        for leftover in ckpts.glob(".step-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # an interrupted save: never a good checkpoint
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "event": start.kind, "step": start.step,
             "pid": os.getpid()}
    if start.branch:
        entry["branch"] = start.branch
    if start.resume_from is not None:
        entry["from"] = str(start.resume_from)
    if start.changes:
        entry["changes"] = start.changes
    with open(run_dir / HISTORY, "a") as f:
        f.write(json.dumps(entry) + "\n")


# --- a stop on request ------------------------------------------------------------------------------------

class StopRequests:
    """SIGINT, SIGTERM and SIGHUP ask the run to stop after its current step (and save) instead of ending it
    mid-step.

    ``signum`` is the first signal received (None: go on). A second one while the run saves is reported and
    otherwise ignored: the save finishes (it is atomic either way; SIGKILL leaves the previous checkpoint).
    Handlers are installed only in the main thread (Python refuses elsewhere) and restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal closed (exit 129)

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum = signum
            message = f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint\n"
        else:
            message = (f"\n{signal.Signals(signum).name}: already stopping; the step and its checkpoint are not "
                       "interrupted (SIGKILL would leave the previous checkpoint)\n")
        os.write(2, message.encode())


def stopped(signum: int, step: int, max_steps: int, last_good: Path | None, *, saves: bool,
            continue_with: str) -> Interrupted:
    """The error that ends a run stopped on request (either engine): where its state is, and the command that
    continues it. ``saves``: whether the run writes checkpoints at all (``train.checkpoint_every`` > 0)."""
    if last_good is not None and last_good.name == f"step-{step:08d}":
        saved = f"checkpoint {last_good}"
    elif not saves:
        saved = "no checkpoint (train.checkpoint_every=0)"
    else:
        saved = f"no new checkpoint; the newest is {last_good or 'none'}"
    return Interrupted(f"stopped by {signal.Signals(signum).name} after step {step} of {max_steps}: {saved}",
                       signum=signum, hint=f"continue with: {continue_with}")
