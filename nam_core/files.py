"""The one atomic file write: the bytes go to a hidden sibling (``.<name>.tmp-<pid>``), are flushed to disk,
then renamed over the target. Rename is atomic on POSIX, so a reader (or a resume after ``kill -9``) sees the
old file or the new one, never a torn one. A failed write removes its temporary file and raises the OSError,
which the caller turns into a one-block error (``nam_core.engine.rundir.readable_filesystem_errors``)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename into it, a new file) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """Where ``write_atomic`` puts ``path``'s bytes before the rename (hidden, this process's)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data`` (text is UTF-8) in one rename."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj, **dumps) -> None:
    """``obj`` as indented JSON (values JSON does not know as their ``str``), replacing ``path`` in one rename."""
    dumps = {"indent": 2, "default": str, **dumps}
    write_atomic(path, json.dumps(obj, **dumps) + "\n")
