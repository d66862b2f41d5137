"""Atomic, verifiable checkpoints: written aside, fsynced, renamed into place, with a manifest.

Layout under the run folder::

    checkpoints/step-00000060/      model.pt  optimizer.pt  scheduler.pt  rng.pt  manifest.json
    checkpoints/.step-00000080.tmp-<pid>/   a save in progress (ignored, removed by the next save)

A checkpoint is *good* when its folder has its final name and its manifest's sha256 of every file matches.
Rename is atomic on POSIX, so a crash or ``kill -9`` mid-save leaves only a ``.tmp`` folder behind and
never damages the last good checkpoint. Old checkpoints are deleted only after a new one is in place.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from nam_core.data.dataset import file_sha256
from nam_core.errors import NamError

FILES = ("model.pt", "optimizer.pt", "scheduler.pt", "rng.pt")
FORMAT = 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _fault_injection(step: int) -> None:
    """Tests set NAM_TEST_KILL_DURING_SAVE=N to SIGKILL this process halfway through saving step N."""
    if os.environ.get("NAM_TEST_KILL_DURING_SAVE") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def save(ckpt_root: Path, step: int, *, model, optimizer, scheduler, extra: dict, keep: int) -> Path:
    """Write checkpoint ``step`` atomically; return its folder. ``extra`` goes into the manifest."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    for stale in ckpt_root.glob(".step-*.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # leftovers of a killed save: never a good checkpoint
    final = ckpt_root / f"step-{step:08d}"
    tmp = ckpt_root / f".{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        torch.save(model.state_dict(), tmp / "model.pt")
        _fault_injection(step)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        manifest = {"format": FORMAT, "step": step, **extra,
                    "sha256": {name: file_sha256(tmp / name) for name in FILES}}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        for name in (*FILES, "manifest.json"):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. end of a resumed run): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(ckpt_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in good_checkpoints(ckpt_root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old)
    return final


def verify(folder: Path) -> dict | None:
    """The manifest of a good checkpoint folder, or None if it is incomplete or corrupt."""
    manifest_path = folder / "manifest.json"
    if folder.name.startswith(".") or not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return None
    digests = manifest.get("sha256", {})
    for name in FILES:
        if not (folder / name).is_file() or digests.get(name) != file_sha256(folder / name):
            return None
    return manifest


def good_checkpoints(ckpt_root: Path) -> list[Path]:
    """Good checkpoint folders, oldest first."""
    if not ckpt_root.is_dir():
        return []
    folders = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    return [p for p in folders if verify(p) is not None]


def resolve_resume(spec: str, ckpt_root: Path, *, good: Callable[[Path], list[Path]] = good_checkpoints,
                   is_good: Callable[[Path], bool] = lambda folder: verify(folder) is not None,
                   what: str = "checkpoint", why_not: str = "missing files or sha256 mismatch") -> Path:
    """``auto`` -> newest good checkpoint under ``ckpt_root``; a path -> that checkpoint, verified.

    ``good``/``is_good``/``what``/``why_not``: another engine's checkpoint format (the megatron engine's)."""
    if spec == "auto":
        found = good(ckpt_root)
        if not found:
            raise NamError(f"--resume auto: no good {what} under {ckpt_root}",
                           hint="start without --resume, or point --resume at a checkpoint folder")
        return found[-1]
    folder = Path(spec)
    if not is_good(folder):
        raise NamError(f"--resume {spec}: not a complete {what} ({why_not})",
                       hint=f"use --resume auto to take the newest good checkpoint under {ckpt_root}")
    return folder


def load(folder: Path, *, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG from a verified folder; return its manifest."""
    manifest = verify(folder)
    if manifest is None:
        raise NamError(f"checkpoint {folder} failed verification", hint="use --resume auto")
    model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    set_rng_state(torch.load(folder / "rng.pt", weights_only=False))
    return manifest
