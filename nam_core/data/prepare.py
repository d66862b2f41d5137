"""``nam data prepare``: source files -> a prepared dataset folder (see ``nam_core.data.dataset``), atomically.

Sources, decided by what ``src`` is:

- a ``.jsonl`` file: one document per line, from its ``text`` field (blank lines are ignored; a line that is
  not a JSON object with a string ``text`` stops the run with its line number);
- a ``.parquet`` file (needs ``pyarrow``, not a core dependency: nam's ``data`` extra), one document per row:
  a token shard when it has a list-of-int column ``tokens`` or ``input_ids`` (the ids as they are; eod is
  appended unless the row already ends with it; no text, so no structure ids), else a text table when it has
  a string column ``text`` (tokenized like a .jsonl, the common layout of published corpora). Any other
  columns are refused with the names it looked for;
- any other file: one text document;
- a folder: every file under it, walked recursively and sorted by relative path, each file read by the rule
  above. Hidden files and folders (``.git``, ``.venv``) and ``__pycache__`` are not entered. A folder with
  parquet token shards must hold nothing else (their tokens have no text to align structure ids with).

Which text files count. Not an extension list: code corpora are full of files that no list foresees
(``Makefile``, ``Dockerfile``, ``.bzl``, ``.cu``). A file is text when it decodes as strict UTF-8 and has no
NUL byte; anything else is skipped and counted by reason (``binary``, ``not_utf8``), as are empty files
(``empty_file``) and empty jsonl records or parquet rows (``empty_record``).

Every document is tokenized, ended with the tokenizer's eod, and written as one sequence of a Megatron-Core
indexed dataset (``tokens.bin``/``tokens.idx``). With ``annotate`` (a callable ``text -> list[int]`` of one
structure id per character, e.g. ``nam56r.blocks.structure.char_structure_ids``), a second indexed dataset
``structure.bin``/``.idx`` holds one id per token: the id of the token's first character, 0 for eod.

Atomicity. Everything is written into the sibling folder ``<out>.tmp-<pid>`` and renamed onto ``out`` at the
end; on any failure (an exception, Ctrl-C, SIGTERM under ``nam data prepare``) that folder is removed. So a
folder named ``out`` with a manifest is always complete. An existing non-empty ``out`` is refused unless
``overwrite=True``; then the old folder is renamed aside (``<out>.old-<pid>``), the new one renamed in, and
the old one deleted. A process killed outright (SIGKILL, a power cut) cleans nothing; the next prepare of the
same ``out`` removes the ``.tmp-<pid>`` and ``.old-<pid>`` folders whose process is gone (an ``.old-`` one is
renamed back when ``out`` is missing: it is then the only copy) and says so on stderr.

Validation. ``val_fraction`` holds ``round(val_fraction * documents)`` documents (at least one when it is
above 0, and never all of them), spread evenly through the files, out of training: the manifest's
``validation_documents`` (``nam_core.data.dataset``: Splits). The embedded stdlib corpus holds out ``STDLIB_VAL_FRACTION``.

The manifest records the sha256 of every file (``nam_core.data.integrity``), and the stamp that spares the
first open a re-hash is written once the folder has its final name.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import numpy as np

from nam_core.data import integrity, missing_package
from nam_core.data.dataset import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    STRUCTURE,
    TOKENS,
    file_sha256,
    indexed_dataset_module,
    open_dataset,
)
from nam_core.data.tokenizer import Tokenizer
from nam_core.engine.rundir import READ_ONLY, disk_full, free_mb, mount_point, unwritable
from nam_core.errors import ConfigError, DataError, RunFolderError

Annotator = Callable[[str], "list[int]"]

STRUCTURE_DTYPE = np.uint16  # structure ids are a small vocabulary (NAM56R: 16); uint16 leaves room
TOKEN_COLUMNS = ("tokens", "input_ids")  # parquet columns read as token ids, in this order
TEXT_COLUMN = "text"  # the parquet column read as text when there is no token column
# Why a source file was not read (counted in the manifest); empty jsonl records / parquet rows count as
# "empty_record" and are not files.
FILE_SKIP_REASONS = ("binary", "not_utf8", "empty_file")

# The embedded default corpus: the first files of the standard library (sorted by path) up to this much
# source text. 4 MiB is ~40% of CPython 3.11's non-test stdlib (601 files, 11 MB), prepared in a few
# seconds on 2 cores, and far more tokens than a CPU run of nam56r-tiny consumes.
STDLIB_MAX_BYTES = 4 * 2**20
# The stdlib corpus's held-out share of its files (spread through it): 3% of CPython 3.11's 266 is 8 files,
# 154 KB of source (as many byte tokens), twice what one evaluation at train.eval_tokens' default reads.
STDLIB_VAL_FRACTION = 0.03
# Folders of the stdlib that are not the library itself: tests (lib2to3's hold deliberately broken Python),
# IDLE, installed packages, bytecode.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "lib2to3", "__pycache__"}
)


@dataclass
class PrepareSummary:
    """What ``prepare`` wrote: counts for the CLI, the same numbers the manifest holds."""

    out: Path
    source_kind: str
    documents: int
    tokens: int
    max_token_id: int
    files_read: int
    files_skipped: int
    skipped: dict[str, int] = field(default_factory=dict)
    cleaned: list[str] = field(default_factory=list)
    """What was left by an earlier, killed prepare of the same ``out`` and removed (or restored)."""
    structure: bool = False
    structure_note: str = ""
    seconds: float = 0.0
    validation_documents: int = 0
    """The last documents held out for validation (``--val-fraction``)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out"] = str(self.out)
        return d


class _Document(NamedTuple):
    where: str  # "file" or "file:line" or "file row N", for error messages
    text: str | None  # None for pre-tokenized documents
    ids: np.ndarray | None  # pre-tokenized ids (parquet), else None
    nbytes: int  # source bytes this document accounts for (progress)


@dataclass
class _Source:
    """The resolved input: the files to read, in order, and how each one is read."""

    files: list[Path]
    parquet: dict[Path, tuple[str, str]] = field(default_factory=dict)
    """Each parquet file's layout: ``("tokens", column)`` or ``("text", "text")`` (``_parquet_layout``)."""

    def kind(self, path: Path) -> str:
        """``text``, ``jsonl``, ``parquet-tokens`` or ``parquet-text``."""
        if _kind_of(path) != "parquet":
            return _kind_of(path)
        return f"parquet-{self.parquet[path][0]}"

    @property
    def kinds(self) -> list[str]:
        return sorted({self.kind(f) for f in self.files})

    @property
    def has_text(self) -> bool:
        return any(self.kind(f) != "parquet-tokens" for f in self.files)


def _kind_of(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


def _skip(counts: dict[str, int], reason: str) -> None:
    counts[reason] = counts.get(reason, 0) + 1


# ----------------------------------------------------------------------------------------- sources


def _walk(root: Path, out: Path) -> list[Path]:
    """Every regular file under ``root``, sorted by relative path.

    Not entered: hidden folders, ``__pycache__``, and ``out`` with its temp/old siblings (``--out`` may lie
    inside the source folder).
    """
    out = out.resolve()

    def skipped(folder: Path) -> bool:
        if folder.name.startswith(".") or folder.name == "__pycache__":
            return True
        folder = folder.resolve()
        return folder == out or (folder.parent == out.parent and folder.name.startswith(
            (f"{out.name}.tmp-", f"{out.name}.old-")))

    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not skipped(here / d)]
        found += [here / f for f in filenames if not f.startswith(".") and (here / f).is_file()]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _require_pyarrow(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise missing_package("pyarrow", f"reading the parquet file {path}") from None
    return pq


def _parquet_layout(path: Path) -> tuple[str, str]:
    """How a parquet file is read, from its schema alone: ``("tokens", column)`` for a token shard, ``("text",
    "text")`` for a text table. A token column wins over ``text``: its ids are the data as published."""
    pq = _require_pyarrow(path)
    from pyarrow import ArrowException

    try:
        names = pq.read_schema(path).names
    except (ArrowException, OSError) as e:  # ArrowInvalid for a file that is not parquet, OSError unreadable
        raise DataError(f"{path} is not a readable parquet file: {e}",
                        hint="check the file, or remove it from the source folder") from None
    column = next((c for c in TOKEN_COLUMNS if c in names), None)
    if column is not None:
        return "tokens", column
    if TEXT_COLUMN in names:
        return "text", TEXT_COLUMN
    raise DataError(
        f"{path}: expected a list-of-int column {' or '.join(repr(c) for c in TOKEN_COLUMNS)} (token ids) or a "
        f"string column {TEXT_COLUMN!r} (text, tokenized with --tokenizer), found columns {names}",
        hint=f"rename the column that holds the documents to {TEXT_COLUMN!r} (or the token ids to "
             f"{TOKEN_COLUMNS[0]!r}), then prepare again",
    )


def _resolve_source(src: Path, out: Path) -> _Source:
    if not src.exists():
        raise DataError(
            f"source not found: {src} (expected a folder of text/code files, a .jsonl file or a .parquet file)",
            hint="nam data prepare PATH/TO/SOURCE --out DIR",
        )
    if src.is_file():
        source = _Source(files=[src])
    else:
        source = _Source(files=_walk(src, out))
        if not source.files:
            raise DataError(f"{src} holds no files to prepare", hint="nam data prepare PATH/TO/SOURCE --out DIR")
    source.parquet = {f: _parquet_layout(f) for f in source.files if _kind_of(f) == "parquet"}
    shards = [f for f in source.files if source.kind(f) == "parquet-tokens"]
    others = [f for f in source.files if source.kind(f) != "parquet-tokens"]
    if shards and others:
        raise DataError(
            f"{src} mixes parquet token shards (first: {shards[0]}) with {len(others)} text source(s) (first: "
            f"{others[0]}); token shards have no text to align structure ids with, so they are prepared on "
            "their own",
            hint="put the token shards in their own folder and prepare it separately",
        )
    return source


def _text_documents(path: Path, where: str, skipped: dict[str, int]) -> Iterator[_Document]:
    data = path.read_bytes()
    if not data:
        _skip(skipped, "empty_file")
        return
    if b"\x00" in data:
        _skip(skipped, "binary")
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        _skip(skipped, "not_utf8")
        return
    yield _Document(where, text, None, len(data))


def _jsonl_documents(path: Path, where: str, skipped: dict[str, int]) -> Iterator[_Document]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            line_at = f"{where}:{number}"
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{line_at}: not a JSON line ({e})",
                                hint=f"fix or delete line {number} of {path}, then prepare again") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                found = f"keys {sorted(record)}" if isinstance(record, dict) else type(record).__name__
                if isinstance(record, dict) and "text" in record:
                    found = f"'text' of type {type(record['text']).__name__}"
                raise DataError(
                    f"{line_at}: expected a JSON object with a string field 'text', found {found}",
                    hint=f"fix or delete line {number} of {path}, then prepare again",
                )
            if not text:
                _skip(skipped, "empty_record")
                continue
            yield _Document(line_at, text, None, len(raw))


def _parquet_documents(path: Path, where: str, skipped: dict[str, int], layout: tuple[str, str]
                       ) -> Iterator[_Document]:
    """One document per row of ``layout``'s column: token ids as they are, or text to tokenize."""
    pq = _require_pyarrow(path)
    kind, column = layout
    shard = pq.ParquetFile(path)
    rows = max(shard.metadata.num_rows, 1)
    share = path.stat().st_size / rows  # progress: spread the file's bytes over its rows
    row = 0
    for batch in shard.iter_batches(columns=[column], batch_size=1024):
        for value in batch.column(0).to_pylist():
            at = f"{where} row {row}"
            row += 1
            if kind == "text":
                if value is not None and not isinstance(value, str):
                    raise DataError(f"{at}: column {column!r} holds {type(value).__name__}, expected a string",
                                    hint=f"write the documents as strings in {column!r}")
                if not value:
                    _skip(skipped, "empty_record")
                    continue
                yield _Document(at, value, None, int(share))
                continue
            if value is None or (value and not all(isinstance(i, int) for i in value)):
                raise DataError(f"{at}: column {column!r} is not a list of ints",
                                hint="write token ids as list<int64> (or int32)")
            if not value:
                _skip(skipped, "empty_record")
            else:
                yield _Document(at, None, np.asarray(value, dtype=np.int64), int(share))


def _documents(source: _Source, skipped: dict[str, int]) -> Iterator[_Document]:
    for path in source.files:
        kind = _kind_of(path)
        if kind == "parquet":
            yield from _parquet_documents(path, str(path), skipped, source.parquet[path])
        else:
            yield from {"text": _text_documents, "jsonl": _jsonl_documents}[kind](path, str(path), skipped)


# ----------------------------------------------------------------------------------------- writing


def _check_destination(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is a file; a prepared dataset is a folder",
                          hint="choose another --out folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out} exists and is not empty; nothing was written",
                          hint="pass --overwrite to replace it, or choose another --out folder")


def _check_writable(out: Path) -> None:
    """Before anything is written: the folder ``out`` goes into must be on a writable filesystem."""
    parent = Path(os.path.abspath(out)).parent
    while not parent.exists():
        parent = parent.parent
    why = unwritable(parent)
    if why == READ_ONLY:
        raise RunFolderError(f"cannot write the dataset folder {out}: {parent} is on a read-only filesystem; nothing was written",
                             hint="choose an --out folder on a writable disk")
    if why is not None:
        raise RunFolderError(f"cannot write the dataset folder {out}: permission denied on {parent}; nothing was written",
                             hint=f"make {parent} writable, or choose another --out folder")


def _size_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20 if folder.is_dir() else 0.0


def _unwritable(exc: BaseException, out: Path, written_mb: float, *, total_bytes: int) -> RunFolderError | None:
    """A failed prepare as the filesystem error it was (exit 6), or None for any other failure."""
    if disk_full(exc):
        disk = mount_point(out.parent)
        free = free_mb(disk)
        return RunFolderError(
            f"no space left on {disk} writing the dataset folder {out}: it needs more than the {written_mb:.0f} MB "
            f"written when the disk filled (source {total_bytes / 2**20:.0f} MB, {free or 0:.0f} MB free now); "
            "the half-written folder was removed",
            hint="free space on that disk, or choose an --out folder on another one")
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return RunFolderError(f"cannot write the dataset folder {out}: {exc.strerror} ({exc.filename}); nothing was kept",
                              hint="choose an --out folder on a writable disk")
    return None


def _move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` onto ``out``; an old ``out`` is set aside first and deleted after."""
    _check_destination(out, overwrite)  # again: it may have appeared while we were writing
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            old.rename(out)  # put the old dataset back before the caller removes tmp
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (one owned by another user counts as alive)."""
    if pid <= 0:
        return True  # not a pid we wrote: leave the folder alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_leftovers(out: Path) -> list[str]:
    """Remove the ``<out>.tmp-<pid>`` and ``<out>.old-<pid>`` folders of killed prepares (their pid is gone);
    an ``.old-`` folder is renamed back to ``out`` when ``out`` is missing, since it is then the only copy.
    Each action is printed on stderr and returned."""
    if not out.parent.is_dir():
        return []
    notes = []
    stale = []
    for sibling in sorted(out.parent.iterdir()):
        kind, _, pid = sibling.name[len(out.name):].partition("-")
        if sibling.name.startswith(out.name) and kind in (".tmp", ".old") and pid.isdigit():
            if int(pid) != os.getpid() and not _alive(int(pid)):
                stale.append((kind, int(pid), sibling))
    for kind, pid, sibling in sorted(stale, key=lambda t: t[0] != ".old"):  # restore before removing
        if kind == ".old" and not out.exists():
            sibling.rename(out)
            notes.append(f"restored {out} from {sibling.name}, set aside by a prepare (pid {pid}) that was killed "
                         "while replacing it")
        else:
            shutil.rmtree(sibling, ignore_errors=True)
            notes.append(f"removed {sibling}, left by a prepare (pid {pid}) that was killed")
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    return notes


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar over source bytes, on stderr, only when stderr is a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr,
                disable=not (enabled and sys.stderr.isatty()), leave=False)


def _structure_ids(annotate: Annotator, doc: _Document, char_index: np.ndarray) -> np.ndarray:
    """Per-token structure ids: the id of each token's first character [n] (int64)."""
    chars = np.asarray(annotate(doc.text), dtype=np.int64)
    if chars.shape != (len(doc.text),):
        raise DataError(
            f"{doc.where}: the structure annotator returned {chars.size} ids for {len(doc.text)} characters "
            "(expected one per character)",
            hint="prepare without structure ids: nam data prepare SRC --out DIR --no-structure",
        )
    if chars.size and (chars.min() < 0 or chars.max() > np.iinfo(STRUCTURE_DTYPE).max):
        raise DataError(
            f"{doc.where}: structure ids range {chars.min()}..{chars.max()}, "
            f"outside 0..{np.iinfo(STRUCTURE_DTYPE).max}",
            hint="prepare without structure ids: nam data prepare SRC --out DIR --no-structure",
        )
    return chars[char_index]


def _write(
    source: _Source,
    out: Path,
    tokenizer: Tokenizer,
    *,
    annotate: Annotator | None,
    overwrite: bool,
    progress: bool,
    source_info: dict,
    val_fraction: float = 0.0,
) -> PrepareSummary:
    started = time.perf_counter()
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction {val_fraction}: expected a share of the documents in [0, 1)",
                          hint="e.g. --val-fraction 0.01 holds out 1% of the documents for validation")
    _check_writable(out)
    cleaned = _clean_leftovers(out)
    _check_destination(out, overwrite)
    if annotate is None:
        structure, note = False, "not requested"
    elif not source.has_text:
        structure, note = False, "parquet token shards carry no text to derive structure ids from"
    else:
        structure, note = True, "one id per token: the id of its first character; eod is 0"

    indexed = indexed_dataset_module()
    token_dtype = indexed.DType.optimal_dtype(tokenizer.vocab_size)  # Megatron's rule: uint16 below 65500
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of this pid can only be from a killed earlier run
    builders = []
    scanned: dict[str, tuple[str, int]] = {}  # .bin name -> (sha256, largest id), stamped once in place
    try:
        tmp.mkdir(parents=True)
        tokens_out = indexed.IndexedDatasetBuilder(str(tmp / f"{TOKENS}.bin"), dtype=token_dtype)
        builders.append((TOKENS, tokens_out))
        structure_out = None
        if structure:
            structure_out = indexed.IndexedDatasetBuilder(str(tmp / f"{STRUCTURE}.bin"), dtype=STRUCTURE_DTYPE)
            builders.append((STRUCTURE, structure_out))

        skipped: dict[str, int] = {}
        documents = tokens = 0
        max_id = max_struct = -1
        eod = np.asarray([tokenizer.eod], dtype=np.int64)
        total_bytes = sum(f.stat().st_size for f in source.files)
        with _progress_bar(total_bytes, progress) as bar:
            for doc in _documents(source, skipped):
                if doc.ids is not None:  # pre-tokenized
                    ids = doc.ids
                    if ids.min() < 0 or ids.max() >= tokenizer.vocab_size:
                        raise DataError(
                            f"{doc.where}: token ids range {ids.min()}..{ids.max()}, outside the tokenizer "
                            f"{tokenizer.name!r} (vocab {tokenizer.vocab_size})",
                            hint="pass the tokenizer the shards were made with: --tokenizer PATH/TO/tokenizer.json",
                        )
                    if ids[-1] != tokenizer.eod:
                        ids = np.concatenate([ids, eod])
                    char_index = None
                elif structure_out is not None:
                    ids, char_index = tokenizer.encode_with_offsets(doc.text)
                    ids = np.concatenate([ids, eod])
                else:
                    ids = np.concatenate([tokenizer.encode(doc.text), eod])
                tokens_out.add_document(ids, [len(ids)])
                if structure_out is not None:
                    per_token = _structure_ids(annotate, doc, char_index)
                    per_token = np.concatenate([per_token, [0]])  # eod's structure id
                    structure_out.add_document(per_token, [len(per_token)])
                    max_struct = max(max_struct, int(per_token.max()))
                documents += 1
                tokens += len(ids)
                max_id = max(max_id, int(ids.max()))
                bar.update(doc.nbytes)

        if documents == 0:
            reasons = ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())) or "nothing found"
            raise DataError(f"no documents to prepare in {source_info['path']} (skipped: {reasons})",
                            hint="point SRC at UTF-8 text/code files, a .jsonl with a 'text' field, or parquet shards")
        for prefix, builder in builders:
            builder.finalize(str(tmp / f"{prefix}.idx"))
        held = held_out_documents(documents, val_fraction, where=source_info["path"])

        files_skipped = sum(skipped.get(r, 0) for r in FILE_SKIP_REASONS)
        files_read = len(source.files) - files_skipped
        summary = PrepareSummary(
            out=out,
            source_kind="+".join(source.kinds),
            documents=documents,
            tokens=tokens,
            max_token_id=max_id,
            files_read=files_read,
            files_skipped=files_skipped,
            skipped=skipped,
            cleaned=cleaned,
            structure=structure,
            structure_note=note,
            validation_documents=held,
        )
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "tokenizer": tokenizer.describe(),
            "source": {**source_info, "kind": summary.source_kind},
            "documents": documents,
            "validation_documents": held,
            "tokens": tokens,
            "max_token_id": max_id,
            "token_dtype": np.dtype(token_dtype).name,
            "files_read": files_read,
            "files_skipped": files_skipped,
            "skipped": skipped,
            "structure": {"present": structure, "note": note},
            "sha256": {},
        }
        for prefix, _ in builders:
            scanned[f"{prefix}.bin"] = integrity.scan(tmp / f"{prefix}.bin", np.dtype(
                token_dtype if prefix == TOKENS else STRUCTURE_DTYPE), progress=False)
            manifest["sha256"][f"{prefix}.bin"] = scanned[f"{prefix}.bin"][0]
            manifest["sha256"][f"{prefix}.idx"] = file_sha256(tmp / f"{prefix}.idx")
        if structure:
            # The annotator's labels can depend on the interpreter (the set of builtins), so record both.
            manifest["structure"].update(
                dtype=np.dtype(STRUCTURE_DTYPE).name,
                max_id=max_struct,
                annotator=f"{getattr(annotate, '__module__', '?')}.{getattr(annotate, '__qualname__', '?')}",
                python=platform.python_version(),
            )
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _move_into_place(tmp, out, overwrite)
    except BaseException as exc:
        written = _size_mb(tmp)
        for _, builder in builders:
            with contextlib.suppress(OSError):  # closing flushes: on a full disk it fails again
                builder.data_file.close()
        shutil.rmtree(tmp, ignore_errors=True)
        unwritable = _unwritable(exc, out, written, total_bytes=sum(f.stat().st_size for f in source.files))
        if unwritable is not None:
            raise unwritable from exc
        raise
    for name, (digest, largest) in scanned.items():
        integrity.record(out, name, digest, largest, np.dtype(token_dtype if name == f"{TOKENS}.bin"
                                                              else STRUCTURE_DTYPE))  # the first open need not hash
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary


def prepare(
    src: str | Path,
    out: str | Path,
    tokenizer: Tokenizer,
    *,
    annotate: Annotator | None = None,
    overwrite: bool = False,
    progress: bool = True,
    val_fraction: float = 0.0,
) -> PrepareSummary:
    """Prepare ``src`` (folder, .jsonl or .parquet; see the module docstring) into the dataset folder ``out``,
    the last ``val_fraction`` of its documents held out for validation."""
    src, out = Path(src).expanduser(), Path(out).expanduser()
    _check_destination(out, overwrite)
    source = _resolve_source(src, out)
    return _write(source, out, tokenizer, annotate=annotate, overwrite=overwrite, progress=progress,
                  source_info={"path": str(src.resolve())}, val_fraction=val_fraction)


def held_out_documents(documents: int, val_fraction: float, *, where: str) -> int:
    """How many of ``documents`` ``val_fraction`` holds out: at least one when it is above 0,
    and never all of them (DataError when one document is all there is)."""
    if val_fraction == 0:
        return 0
    if documents < 2:
        raise DataError(f"--val-fraction {val_fraction}: {where} holds {documents} document; holding one out "
                        "leaves nothing to train on",
                        hint="prepare more documents, or a validation set apart and pass it as --eval-data DIR")
    return min(documents - 1, max(1, round(val_fraction * documents)))


# ----------------------------------------------------------------------------------------- stdlib corpus


def stdlib_files(*, max_files: int | None = None, max_bytes: int = STDLIB_MAX_BYTES) -> list[Path]:
    """The standard library's own ``.py`` files, sorted by path, capped by count and by total size.

    Files are taken in order while the total stays within ``max_bytes`` (the first one always), and at
    most ``max_files`` of them.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and not d.startswith(".")]
        candidates += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    candidates.sort(key=lambda p: p.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in candidates:
        size = path.stat().st_size
        if chosen and (total + size > max_bytes or (max_files is not None and len(chosen) >= max_files)):
            break
        chosen.append(path)
        total += size
    return chosen


def build_stdlib_corpus(
    cache_dir: str | Path,
    tokenizer: Tokenizer,
    annotate: Annotator | None,
    *,
    max_files: int | None = None,
    max_bytes: int = STDLIB_MAX_BYTES,
    progress: bool = False,
) -> Path:
    """The embedded default corpus, prepared once into ``cache_dir/stdlib-<tokenizer>-py<major><minor>``.

    It is the installed Python standard library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``
    without site-packages, test suites, idlelib or lib2to3), sorted by path, capped at ``max_bytes`` of
    source (default 4 MiB: 266 files on CPython 3.11) and optionally ``max_files``. A folder that is
    already there is reused when it opens cleanly and was built with the same tokenizer, cap and structure
    choice; otherwise it is rebuilt. ``STDLIB_VAL_FRACTION`` of its files are held out for validation. Since ``prepare`` only ever renames a complete folder into place, a
    present manifest means a finished build.
    """
    cache_dir = Path(cache_dir).expanduser()
    out = cache_dir / f"stdlib-{tokenizer.name}-py{sys.version_info.major}{sys.version_info.minor}"
    root = Path(sysconfig.get_paths()["stdlib"])
    source_info = {"path": str(root), "stdlib": True, "max_files": max_files, "max_bytes": max_bytes,
                   "val_fraction": STDLIB_VAL_FRACTION}
    if _reusable(out, tokenizer, source_info, structure=annotate is not None):
        return out
    files = stdlib_files(max_files=max_files, max_bytes=max_bytes)
    try:
        _write(_Source(files=files), out, tokenizer, annotate=annotate, overwrite=True,
               progress=progress, source_info=source_info, val_fraction=STDLIB_VAL_FRACTION)
    except RunFolderError as e:
        raise RunFolderError(f"the default corpus cannot be prepared in nam's cache: {e.message}",
                             hint="point NAM_CACHE_DIR at a writable folder, or train on a prepared dataset: "
                                  "--data DIR (nam data prepare SRC --out DIR)") from e
    except DataError:
        # Another process may have finished the same build first; its folder is as good as ours.
        if _reusable(out, tokenizer, source_info, structure=annotate is not None):
            return out
        raise
    return out


def _reusable(out: Path, tokenizer: Tokenizer, source_info: dict, *, structure: bool) -> bool:
    if not (out / MANIFEST).is_file():
        return False
    try:
        dataset = open_dataset(out)
    except DataError:
        return False  # a damaged cache: rebuilt by the caller
    manifest = dataset.manifest
    return (
        manifest["tokenizer"] == tokenizer.describe()
        and all(manifest["source"].get(k) == v for k, v in source_info.items())
        and bool(manifest["structure"]["present"]) == structure
    )
