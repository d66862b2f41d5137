"""A prepared dataset on disk, opened and checked, and read as one stream of tokens.

A prepared dataset (written by ``nam_core.data.prepare``) is a folder:

    dataset.json             manifest: format version, tokenizer, counts, sha256 of every .idx and .bin,
                             and how many documents at the end are held out for validation
    tokens.bin / tokens.idx  Megatron-Core indexed dataset, one sequence per document, eod appended
    structure.bin / .idx     optional: one structure id per token, same lengths as tokens

``open_dataset`` refuses anything it cannot trust: a missing or malformed manifest, a missing file, an .idx
or .bin whose sha256 differs from the manifest, a .bin whose size does not match the token count, ids above
the manifest's largest. A .bin is hashed in full once, then only when its stat changes
(``nam_core.data.integrity``); a manifest from before .bin checksums is refused with the command that adds
them (``nam data checksum``).

Reading goes through Megatron-Core's ``IndexedDataset`` with mmap, so a corpus never has to fit in RAM. The
documents are concatenated in file order into one token stream; ``PreparedDataset.read(start, stop)``
returns any window of that stream, and ``PackedSequences`` cuts that stream into training rows.

Packing. Row ``i`` covers stream positions ``[i*seq_len, i*seq_len + seq_len + 1)``: ``tokens`` is its first
``seq_len`` ids and ``labels`` its last ``seq_len`` (the next token of each). Rows overlap by one position, so
every stream token but the first is a label exactly once. Documents run on into each other, each ended by its
eod; ``segment_ids`` (0, 1, ... for each new document within the row) and ``positions`` (offset within the
document) let blocks that must not look across documents reset there. ``loss_mask`` is 1 on every label,
the eod -> next-document label included (Megatron-LM's default, ``eod_mask_loss=False``), and 0 only on the
padding that fills the last row past the end of the stream.

Splits. ``validation_documents: N`` in the manifest (``nam data prepare --val-fraction``) holds N documents
out of training, spread evenly through the files (``held_out(D, N)``: document ``(2j + 1) * D // (2N)`` for
``j < N``), so a folder prepared in path order does not lose its last folder (the stdlib corpus's tail is
``encodings/iso8859_*.py``, five near-identical codec tables). ``split("train")`` and ``split("validation")``
are views of their documents, each read as its own stream; a document is never cut between them. A manifest
without the field holds nothing out.

Order. Rows are visited in a permutation drawn from ``numpy.random.default_rng([seed, epoch])``, a fresh one
each epoch. Sample ``k = step * batch_size + j`` is row ``perm(seed, k // rows)[k % rows]``, so
``batch_at(step, batch_size)`` is a pure function of (seed, step, batch_size): a resumed run needs nothing
but the step number to continue the same order.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from nam_core.data.integrity import file_sha256, verify
from nam_core.errors import DataError
from nam_core.files import write_json_atomic

MANIFEST = "dataset.json"
FORMAT = "nam-dataset"
FORMAT_VERSION = 1
TOKENS = "tokens"  # file prefix: tokens.bin, tokens.idx
STRUCTURE = "structure"  # file prefix: structure.bin, structure.idx


def indexed_dataset_module() -> ModuleType:
    """``megatron.core.datasets.indexed_dataset``, imported without its Transformer Engine warnings.

    Importing it pulls in megatron.core, which warns that Transformer Engine and Apex are absent; on a
    CPU machine that is expected and says nothing about the data, so only those warnings are silenced.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*Transformer Engine.*")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def _prepare_hint(path: Path) -> str:
    return f"nam data prepare SRC --out {path}"


def _checksum_hint(path: Path) -> str:
    return (f"record them: nam data checksum {path} (trusts the .bin files as they are now), or prepare it "
            f"again: {_prepare_hint(path)} --overwrite")


@dataclass
class PreparedDataset:
    """An opened, checked dataset folder: the token stream, its documents, optional structure ids."""

    path: Path
    manifest: dict
    tokens: object  # megatron.core.datasets.indexed_dataset.IndexedDataset
    structure: object | None  # the same, for structure ids; None when the dataset has none
    doc_starts: np.ndarray  # [documents + 1] int64: stream offset of each document, then the total
    integrity: dict | None = None  # .bin name -> what its check found (nam_core.data.integrity.verify)
    document_ids: np.ndarray | None = None  # a split's documents, as indices into the files; None: all of them
    split_name: str = "all"  # "all", "train" or "validation"

    @property
    def validation_documents(self) -> int:
        """Documents at the end of the files held out for validation (the manifest's; 0 when it has none)."""
        return int(self.manifest.get("validation_documents", 0))

    def split(self, name: str) -> "PreparedDataset":
        """The ``train`` or ``validation`` documents as a dataset of their own (module docstring: Splits)."""
        if self.split_name != "all" or name not in ("train", "validation"):
            raise ValueError(f"split {name!r} of a {self.split_name!r} view: only 'train' or 'validation' of a "
                             "whole dataset")
        held = held_out(self.documents, self.validation_documents)
        ids = held if name == "validation" else np.setdiff1d(np.arange(self.documents), held)
        lengths = np.diff(self.doc_starts)[ids]
        starts = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        return dataclasses.replace(self, doc_starts=starts, document_ids=ids, split_name=name)

    def _file_document(self, index: int) -> int:
        return index if self.document_ids is None else int(self.document_ids[index])

    @property
    def documents(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream, eod tokens included."""
        return int(self.doc_starts[-1])

    @property
    def max_token_id(self) -> int:
        return int(self.manifest["max_token_id"])

    @property
    def tokenizer(self) -> dict:
        """The tokenizer's ``describe()`` as saved at preparation."""
        return self.manifest["tokenizer"]

    @property
    def eod(self) -> int:
        return int(self.manifest["tokenizer"]["eod"])

    @property
    def has_structure(self) -> bool:
        return self.structure is not None

    def check_vocab(self, model_vocab: int) -> None:
        """Refuse a model whose embedding has no row for the dataset's largest token id (or its eod)."""
        if self.max_token_id >= model_vocab:
            raise DataError(
                f"{self.path / (TOKENS + '.bin')} holds token id {self.max_token_id} but the model's vocabulary has "
                f"{model_vocab} ids (0..{model_vocab - 1}); tokenizer {self.tokenizer.get('name')!r} "
                f"has {self.tokenizer.get('vocab_size')}",
                hint=f"raise the model's vocab_size to at least {self.max_token_id + 1}, or prepare the "
                f"data with the model's tokenizer: {_prepare_hint(self.path)} --tokenizer PATH",
            )
        eod = self.tokenizer.get("eod")
        if isinstance(eod, int) and eod >= model_vocab:
            raise DataError(
                f"{self.path / MANIFEST}: tokenizer.eod is {eod} but the model's vocabulary has {model_vocab} ids "
                f"(0..{model_vocab - 1})",
                hint=f"raise the model's vocab_size to at least {eod + 1}, or prepare the data with the model's "
                     f"tokenizer: {_prepare_hint(self.path)} --tokenizer PATH")

    def document(self, index: int, *, structure: bool = False) -> np.ndarray:
        """One document's ids (eod included) [n]."""
        source = self.structure if structure else self.tokens
        if source is None:
            raise DataError(f"{self.path} has no structure ids", hint=_prepare_hint(self.path))
        return np.asarray(source.get(self._file_document(index)), dtype=np.int64)

    def read(self, start: int, stop: int, *, structure: bool = False) -> np.ndarray:
        """Stream positions [start, stop) as int64 [stop - start], across document boundaries."""
        source = self.structure if structure else self.tokens
        if source is None:
            raise DataError(f"{self.path} has no structure ids", hint=_prepare_hint(self.path))
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"stream window [{start}, {stop}) outside [0, {self.num_tokens})")
        parts = []
        doc = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            doc_start, doc_end = int(self.doc_starts[doc]), int(self.doc_starts[doc + 1])
            take = min(stop, doc_end) - pos
            if take > 0:
                parts.append(source.get(self._file_document(doc), offset=pos - doc_start, length=take))
                pos += take
            doc += 1
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts).astype(np.int64)


def held_out(documents: int, count: int) -> np.ndarray:
    """The ``count`` documents of ``documents`` held out for validation, spread evenly: [count] int64, ascending.
    ``(2j + 1) * D // (2N)`` is the middle of the j-th of N equal slices, distinct for N <= D."""
    return (2 * np.arange(count, dtype=np.int64) + 1) * documents // (2 * count) if count else np.zeros(0, np.int64)


def check_prepared(path: str | Path) -> None:
    """DataError (exit 4) unless ``path`` holds a readable manifest of this nam's format: what ``open_dataset``
    refuses first, without reading a token (``nam train --dry-run --data DIR``)."""
    _load_manifest(Path(path).expanduser())


def _load_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    if path.exists() and not path.is_dir():
        raise DataError(f"{path} is a file; a prepared dataset is a folder holding {MANIFEST}, tokens.bin and "
                        "tokens.idx", hint=f"point at the folder `nam data prepare` wrote: {_prepare_hint(path)}")
    if not manifest_path.is_file():
        what = "does not exist" if not path.exists() else f"has no {MANIFEST} manifest"
        raise DataError(f"no prepared dataset at {path}: the folder {what}", hint=_prepare_hint(path))
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{manifest_path} is not a readable JSON manifest: {e}", hint=_prepare_hint(path)) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(
            f"{manifest_path} is not a nam dataset manifest (expected format {FORMAT!r})",
            hint=_prepare_hint(path),
        )
    if manifest.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{manifest_path} has format version {manifest.get('version')!r}; this nam reads version "
            f"{FORMAT_VERSION}",
            hint=f"prepare it again with this nam: {_prepare_hint(path)} --overwrite",
        )
    _check_fields(manifest, manifest_path)
    return manifest


MANIFEST_FIELDS = {"tokenizer": dict, "documents": int, "tokens": int, "max_token_id": int, "token_dtype": str,
                   "sha256": dict, "structure": dict}
"""Fields ``open_dataset`` reads, and their JSON types: anything else is a manifest it cannot trust."""


def _check_fields(manifest: dict, manifest_path: Path) -> None:
    """Every field the reader needs, of the type it needs, so a hand-edited or truncated manifest is a
    DataError naming the field instead of a TypeError deep in the reader."""
    hint = f"{_prepare_hint(manifest_path.parent)} --overwrite"
    missing = [k for k in MANIFEST_FIELDS if k not in manifest]
    if missing:
        raise DataError(f"{manifest_path} lacks the fields {', '.join(missing)}", hint=hint)
    for key, kind in MANIFEST_FIELDS.items():
        value = manifest[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise DataError(f"{manifest_path}: field {key!r} is {value!r}; expected a JSON "
                            f"{ {dict: 'object', int: 'integer', str: 'string'}[kind] }", hint=hint)
    eod, vocab = manifest["tokenizer"].get("eod"), manifest["tokenizer"].get("vocab_size")
    if not isinstance(eod, int) or isinstance(eod, bool):
        raise DataError(f"{manifest_path}: tokenizer.eod is {eod!r}; expected the end-of-document id (an integer)",
                        hint=hint)
    if isinstance(vocab, int) and not 0 <= eod < vocab:
        raise DataError(f"{manifest_path}: tokenizer.eod is {eod}, outside the tokenizer's vocabulary "
                        f"(vocab_size {vocab}: ids 0..{vocab - 1})", hint=hint)
    dtypes = [manifest["token_dtype"]] + ([manifest["structure"].get("dtype")]
                                          if manifest["structure"].get("present") else [])
    for name in dtypes:
        try:
            kind = np.dtype(name).kind
        except TypeError:
            raise DataError(f"{manifest_path}: dtype {name!r} is not a numpy dtype", hint=hint) from None
        if kind not in "iu":  # ids are integers; Megatron's indexed format stores nothing else
            raise DataError(f"{manifest_path}: dtype {name!r} is not an integer dtype (expected e.g. uint16, int32)",
                            hint=hint)


def _open_indexed(path: Path, prefix: str, manifest: dict, dtype: np.dtype, *, full: bool,
                  progress: bool | None) -> tuple[object, dict]:
    """Check one indexed dataset's files against the manifest, then open it (mmap). Returns it and what the
    .bin's checksum check found."""
    idx, bin_ = path / f"{prefix}.idx", path / f"{prefix}.bin"
    for f in (idx, bin_):
        if not f.is_file():
            raise DataError(f"{f} is missing from the prepared dataset", hint=f"{_prepare_hint(path)} --overwrite")
    expected = manifest["sha256"].get(idx.name)
    found = file_sha256(idx)
    if found != expected:
        raise DataError(
            f"{idx} is corrupt or was changed: sha256 {found[:16]}..., the manifest says {str(expected)[:16]}...",
            hint=f"{_prepare_hint(path)} --overwrite",
        )
    want_bytes = int(manifest["tokens"]) * dtype.itemsize
    if bin_.stat().st_size != want_bytes:
        raise DataError(
            f"{bin_} has {bin_.stat().st_size} bytes; {manifest['tokens']} ids of {dtype.name} need {want_bytes}",
            hint=f"{_prepare_hint(path)} --overwrite",
        )
    if not isinstance(manifest["sha256"].get(bin_.name), str):
        raise DataError(f"{path} was prepared by an older nam: its {MANIFEST} has no checksum of {bin_.name}, so "
                        "bytes changed in it would go unnoticed until training reads them", hint=_checksum_hint(path))
    check = verify(path, bin_.name, manifest["sha256"][bin_.name], dtype, full=full, progress=progress)
    module = indexed_dataset_module()
    try:
        dataset = module.IndexedDataset(str(path / prefix), mmap=True)
    except Exception as e:  # Megatron checks its header and counts with asserts
        raise DataError(f"{idx} cannot be read as a Megatron indexed dataset: {e!r}",
                        hint=f"{_prepare_hint(path)} --overwrite") from e
    if np.dtype(dataset.index.dtype) != dtype:
        raise DataError(f"{idx} stores {np.dtype(dataset.index.dtype).name}, the manifest says {dtype.name}",
                        hint=f"{_prepare_hint(path)} --overwrite")
    return dataset, check


def _check_largest(path: Path, name: str, largest: int, allowed: int, what: str) -> None:
    """Refuse ids in a .bin above what the manifest says it holds (the model's vocabulary is checked against
    the manifest, so this is what keeps an out-of-range id out of an embedding lookup)."""
    if largest > allowed:
        raise DataError(f"{path / name} holds {what} {largest}, above the largest its {MANIFEST} records "
                        f"({allowed}): the file does not match its manifest",
                        hint=f"{_prepare_hint(path)} --overwrite")


def open_dataset(path: str | Path, *, verify_all: bool = False, progress: bool | None = None) -> PreparedDataset:
    """Open a prepared dataset folder after checking it against its manifest; ``DataError`` if it fails.

    ``verify_all``: hash every .bin even when its stamp says it is unchanged (``nam data inspect --verify``).
    ``progress``: a bar while hashing (None: only for large files, on a terminal)."""
    path = Path(path).expanduser()
    manifest = _load_manifest(path)
    tokens, tokens_check = _open_indexed(path, TOKENS, manifest, np.dtype(manifest["token_dtype"]),
                                         full=verify_all, progress=progress)
    _check_largest(path, f"{TOKENS}.bin", tokens_check["max"], manifest["max_token_id"], "token id")
    integrity = {f"{TOKENS}.bin": tokens_check}
    lengths = np.asarray(tokens.sequence_lengths, dtype=np.int64)
    # nam writes one sequence per document; a count that disagrees means the files are not ours.
    documents = len(tokens.document_indices) - 1
    if len(lengths) != documents or documents != manifest["documents"] or int(lengths.sum()) != manifest["tokens"]:
        raise DataError(
            f"{path / 'tokens.idx'} holds {documents} documents in {len(lengths)} sequences and {int(lengths.sum())} "
            f"tokens; the manifest says {manifest['documents']} documents and {manifest['tokens']} tokens",
            hint=f"{_prepare_hint(path)} --overwrite",
        )
    structure = None
    if manifest["structure"].get("present"):
        structure, check = _open_indexed(path, STRUCTURE, manifest, np.dtype(manifest["structure"]["dtype"]),
                                         full=verify_all, progress=progress)
        _check_largest(path, f"{STRUCTURE}.bin", check["max"], int(manifest["structure"].get("max_id", check["max"])),
                       "structure id")
        integrity[f"{STRUCTURE}.bin"] = check
        if not np.array_equal(np.asarray(structure.sequence_lengths, dtype=np.int64), lengths):
            raise DataError(
                f"{path / 'structure.idx'} is not aligned with tokens.idx (different document lengths)",
                hint=f"{_prepare_hint(path)} --overwrite",
            )
    held = manifest.get("validation_documents", 0)
    if not isinstance(held, int) or isinstance(held, bool) or not 0 <= held < documents:
        raise DataError(f"{path / MANIFEST}: validation_documents is {held!r}; expected an integer from 0 to "
                        f"{documents - 1} (documents held out of {documents}, at least one left to train on)",
                        hint=f"{_prepare_hint(path)} --val-fraction F --overwrite")
    doc_starts = np.zeros(documents + 1, dtype=np.int64)
    np.cumsum(lengths, out=doc_starts[1:])
    return PreparedDataset(path=path, manifest=manifest, tokens=tokens, structure=structure, doc_starts=doc_starts,
                           integrity=integrity)


def identity(path: str | Path) -> dict:
    """What makes two prepared datasets the same data: the sha256 of every file, the counts, and the
    validation split (``validation_documents``: prepared again with another ``--val-fraction``, the files are
    the same bytes but other documents train). A run records it, so a resume on data replaced under the same
    path, or split otherwise, is refused (rundir.plan)."""
    manifest = _load_manifest(Path(path).expanduser())
    return {"sha256": dict(sorted(manifest["sha256"].items())), "documents": manifest["documents"],
            "tokens": manifest["tokens"], "validation_documents": int(manifest.get("validation_documents", 0))}


def add_checksums(path: str | Path, *, progress: bool | None = True) -> dict[str, str]:
    """Record the sha256 of every .bin in an older dataset's manifest (``nam data checksum``); returns them.

    The files are trusted as they are now, except that ids above the manifest's largest are refused: those
    bytes are already damaged, and so is a .bin whose sha256 the manifest records and that no longer matches it
    (it is checked, never recorded again). Everything else ``open_dataset`` checks (the .idx hashes, sizes,
    counts) must pass first. The manifest is replaced atomically."""
    from nam_core.data.integrity import record, scan

    path = Path(path).expanduser()
    manifest = _load_manifest(path)
    prefixes = [(TOKENS, manifest["token_dtype"], manifest["max_token_id"], "token id")]
    if manifest["structure"].get("present"):
        prefixes.append((STRUCTURE, manifest["structure"]["dtype"], manifest["structure"].get("max_id"),
                         "structure id"))
    added = {}
    for prefix, dtype, allowed, what in prefixes:
        name = f"{prefix}.bin"
        if not (path / name).is_file():
            raise DataError(f"{path / name} is missing from the prepared dataset",
                            hint=f"{_prepare_hint(path)} --overwrite")
        digest, largest = scan(path / name, np.dtype(dtype), progress=progress)
        if allowed is not None:
            _check_largest(path, name, largest, int(allowed), what)
        if name in manifest["sha256"]:
            if manifest["sha256"][name] != digest:
                raise DataError(f"{path / name} is corrupt or was changed since it was prepared (its sha256 is not "
                                "the one the manifest records); nam data checksum records missing checksums only",
                                hint=f"{_prepare_hint(path)} --overwrite")
            continue
        added[name] = (digest, largest, np.dtype(dtype))
    manifest["sha256"] = {**manifest["sha256"], **{name: digest for name, (digest, _, _) in added.items()}}
    write_json_atomic(path / MANIFEST, manifest, sort_keys=True)
    for name, (digest, largest, dtype) in added.items():
        record(path, name, digest, largest, dtype)  # hashed just now: the next open need not hash again
    open_dataset(path)  # everything else must check out too
    return {name: digest for name, (digest, _, _) in added.items()}


class PackedSequences:
    """Training rows of ``seq_len`` tokens cut from a prepared dataset's stream, in a seeded order."""

    def __init__(self, dataset: PreparedDataset, seq_len: int, seed: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if dataset.num_tokens < 2:
            raise DataError(
                f"{dataset.path} holds {dataset.num_tokens} token(s); a training row needs at least 2",
                hint=f"prepare more text: {_prepare_hint(dataset.path)} --overwrite",
            )
        self.dataset = dataset
        self.seq_len = seq_len
        self.seed = seed
        # Every stream position but the last has a next token to predict: ceil((N - 1) / seq_len) rows.
        self.rows = -(-(dataset.num_tokens - 1) // seq_len)
        self._perms: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.rows

    def row(self, index: int) -> dict[str, np.ndarray]:
        """Row ``index`` (in stream order) as numpy arrays [seq_len]."""
        if not 0 <= index < self.rows:
            raise IndexError(f"row {index} outside [0, {self.rows})")
        ds, length = self.dataset, self.seq_len
        start = index * length
        stop = min(start + length + 1, ds.num_tokens)
        real = stop - start  # ids that exist in the stream; the rest of the row's length + 1 is padding
        pad = length + 1 - real
        ids = np.concatenate([ds.read(start, stop), np.full(pad, ds.eod, dtype=np.int64)])  # [s + 1]

        loss_mask = np.ones(length, dtype=np.float32)
        loss_mask[real - 1:] = 0.0  # label t is the stream id at start + t + 1; it exists for t < real - 1

        # Inputs are stream positions start .. start + length - 1; those past the stream are padding.
        n_in = min(real, length)
        pos = np.arange(start, start + n_in, dtype=np.int64)
        doc = np.searchsorted(ds.doc_starts, pos, side="right") - 1
        segment_ids = np.empty(length, dtype=np.int64)
        positions = np.empty(length, dtype=np.int64)
        segment_ids[:n_in] = doc - doc[0]
        positions[:n_in] = pos - ds.doc_starts[doc]
        # Padding is a segment of its own, so nothing that resets at boundaries mixes it with real tokens.
        segment_ids[n_in:] = segment_ids[n_in - 1] + 1
        positions[n_in:] = np.arange(length - n_in)

        out = {
            "tokens": ids[:-1],
            "labels": ids[1:],
            "loss_mask": loss_mask,
            "segment_ids": segment_ids,
            "positions": positions,
        }
        if ds.has_structure:
            struct = ds.read(start, min(start + length, ds.num_tokens), structure=True)
            out["structure"] = np.concatenate([struct, np.zeros(length - len(struct), dtype=np.int64)])
        return out

    def permutation(self, epoch: int) -> np.ndarray:
        """The order rows are visited in during ``epoch`` [rows] (int64); the last two are cached."""
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.rows)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}  # keep the previous epoch
            self._perms[epoch] = perm
        return perm

    def epoch_at(self, step: int, batch_size: int) -> int:
        """The epoch the first sample of ``step`` belongs to."""
        return (step * batch_size) // self.rows

    def batch_at(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """Batch ``step`` as tensors [batch_size, seq_len]: a pure function of (seed, step, batch_size).

        tokens, labels, segment_ids, positions (and structure when present) are int64; loss_mask is float32.
        """
        if step < 0 or batch_size < 1:
            raise ValueError(f"need step >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}")
        samples = step * batch_size + np.arange(batch_size, dtype=np.int64)
        rows = [int(self.permutation(int(k // self.rows))[k % self.rows]) for k in samples]
        picked = [self.row(r) for r in rows]
        return {key: torch.from_numpy(np.stack([p[key] for p in picked])) for key in picked[0]}
