"""Checksums of a prepared dataset's files, and the stamp that spares an unchanged file its re-hash.

Why hash the .bin files in full: flipped bytes keep a file's size, so a size check lets them through, and the
model then meets a token id past its vocabulary (an IndexError in the middle of training). sha256 reads about
0.9 GB/s on one core of the CPU machine nam is tested on (SHA extensions; blake2b 0.36 GB/s and md5 0.45 GB/s
there), so a full check costs about a second per GB. A sampled hash would be faster and would miss most flips.

Why a stamp: hashing 100 GB at every start costs minutes. Once a file has been hashed and found good, its stat
(size, mtime_ns, ctime_ns, inode, device) is recorded, with the dtype its largest value was read as; an open that finds the same stat and the same expected
digest skips the hash. Every write through the file system moves mtime and ctime (ctime cannot be set back by
``touch`` or ``os.utime``), so bytes changed in place are caught at the next open. A bit that rots on the disk
under an unchanged stat is not: ``nam data inspect --verify`` ignores stamps and re-hashes everything.

Where the stamp lives: ``<dataset>/.nam-verified.json`` (it goes with the data, and a copied folder is
re-hashed once, since its stat differs), or, for a read-only dataset folder, ``<nam cache>/verified/<sha256
of the folder's path>.json``. A stamp that cannot be written is skipped: the next open hashes again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from nam_core.errors import DataError
from nam_core.files import write_json_atomic

BLOCK = 8 << 20
"""Read size: 8 MiB, a multiple of every token dtype's width, large enough that the hash dominates."""
STAMP = ".nam-verified.json"
PROGRESS_BYTES = 256 << 20
"""Files from this size up show a progress bar while they are hashed (on a terminal): ~0.3 s and more."""


class Abandoned(Exception):
    """A hash given up because ``stop`` was set (``file_sha256``): its caller no longer wants it. Never an error
    of the file: whoever needs the digest hashes the file again."""


def file_sha256(path: Path, *, stop: threading.Event | None = None) -> str:
    """Hex sha256 of a file, read in 8 MiB blocks; once ``stop`` is set, ``Abandoned`` at the next block (a
    background hash that must not hold up an exit: nam_core.engine.checkpoint.VerifyAhead)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            if stop is not None and stop.is_set():
                raise Abandoned(f"{path}: hash given up")
            digest.update(block)
    return digest.hexdigest()


def scan(path: Path, dtype: np.dtype, *, progress: bool | None = None) -> tuple[str, int]:
    """sha256 of ``path`` and the largest of its values read as ``dtype`` (-1 for an empty file), in one read.

    ``progress``: True shows a bar on a terminal, None only for files of ``PROGRESS_BYTES`` and more."""
    from tqdm import tqdm

    size = path.stat().st_size
    show = sys.stderr.isatty() and (progress or (progress is None and size >= PROGRESS_BYTES))
    digest, largest = hashlib.sha256(), -1
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=f"verify {path.name}",
                                     file=sys.stderr, disable=not show, leave=False) as bar:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
            usable = len(block) - len(block) % dtype.itemsize
            if usable:
                largest = max(largest, int(np.frombuffer(block, dtype=dtype, count=usable // dtype.itemsize).max()))
            bar.update(len(block))
    return digest.hexdigest(), largest


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def stamp_path(folder: Path) -> Path:
    """Where ``folder``'s stamp lives: inside it, or in nam's cache when the folder is read-only."""
    folder = folder.resolve()
    if os.access(folder, os.W_OK):
        return folder / STAMP
    from nam_core.cache import cache_dir

    return cache_dir() / "verified" / f"{hashlib.sha256(str(folder).encode()).hexdigest()[:32]}.json"


def _load_stamps(folder: Path) -> dict:
    try:
        stamps = json.loads(stamp_path(folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return stamps if isinstance(stamps, dict) else {}


def _save_stamp(folder: Path, name: str, entry: dict) -> None:
    """Add ``entry`` for file ``name`` to ``folder``'s stamp, atomically; silently nothing where it cannot."""
    target = stamp_path(folder)
    stamps = _load_stamps(folder)
    stamps[name] = entry
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(target, stamps, indent=1, sort_keys=True)
    except OSError:
        pass  # the stamp only saves a later hash; the data it describes is unchanged


def record(folder: Path, name: str, digest: str, largest: int, dtype: np.dtype) -> None:
    """Stamp ``folder/name`` as holding ``digest`` (largest value ``largest`` read as ``dtype``) in its current
    stat. The dtype is part of the stamp: a largest value read under another dtype (a manifest whose
    token_dtype was wrong, then fixed) says nothing about the file read as this one."""
    _save_stamp(folder, name, {"sha256": digest, "stat": _stat_key(folder / name), "max": largest,
                               "dtype": np.dtype(dtype).name})


def verify(folder: Path, name: str, expected: str, dtype: np.dtype, *, full: bool = False,
           progress: bool | None = None) -> dict:
    """Check ``folder/name`` against the sha256 ``expected``; returns ``{"sha256", "max", "hashed",
    "seconds"}`` (``hashed`` False: an unchanged file's stamp answered). ``full``: hash even when the stamp
    says the file is unchanged. A mismatch is a DataError naming the file."""
    path = folder / name
    stamp = _load_stamps(folder).get(name) if not full else None
    if (stamp and stamp.get("sha256") == expected and stamp.get("stat") == _stat_key(path)
            and stamp.get("dtype") == np.dtype(dtype).name):
        return {"sha256": expected, "max": int(stamp["max"]), "hashed": False, "seconds": 0.0}
    started = time.perf_counter()
    found, largest = scan(path, dtype, progress=progress)
    if found != expected:
        raise DataError(
            f"{path} is corrupt or was changed since it was prepared: sha256 {found[:16]}..., the manifest "
            f"(dataset.json) says {expected[:16]}... (same size: bytes were changed in place)",
            hint=f"prepare it again: nam data prepare SRC --out {folder} --overwrite",
        )
    record(folder, name, found, largest, dtype)
    return {"sha256": found, "max": largest, "hashed": True, "seconds": round(time.perf_counter() - started, 3)}
