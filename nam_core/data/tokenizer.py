"""Tokenizers: text -> token ids, and back, with the character each token starts at.

Two kinds, one interface (``name``, ``vocab_size``, ``eod``, ``encode``, ``encode_with_offsets``, ``decode``,
``describe``):

- ``ByteTokenizer`` is built in and needs nothing: ids 0..255 are the UTF-8 bytes of the text and 256 is the
  end-of-document token ``eod``, so ``vocab_size`` is 257. Every string round-trips exactly.
- ``HFTokenizer`` reads a Hugging Face ``tokenizer.json`` through the ``tokenizers`` package, which is not a
  core dependency of nam; without it, loading one is a ``DataError`` that says what to install.

``encode_with_offsets`` returns, for every token, the index of the character its span starts at. The data
preparation uses it to align the per-character structure ids of a code file with its tokens (a token takes
the id of its first character). ``describe()`` is saved in the dataset manifest, so a reader of a prepared
dataset knows which vocabulary its ids belong to, and ``tokenizer_from_description`` gets it back.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from nam_core.errors import DataError

# Special tokens that mark the end of a document, in the order they are looked for in a tokenizer.json:
# GPT-2/Qwen/StarCoder "<|endoftext|>", Llama-3 "<|end_of_text|>", SentencePiece-style "</s>", Gemma "<eos>".
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|end|>")


class Tokenizer(Protocol):
    """What the data layer needs from a tokenizer."""

    name: str
    vocab_size: int
    eod: int

    def encode(self, text: str) -> np.ndarray: ...

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def describe(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0..255) plus one end-of-document token (256)."""

    name = "byte"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of ``text`` as int64 ids [n]; lone surrogates (possible in JSON) become '?'."""
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Ids [n] and, per id, the index of the character its byte belongs to [n] (both int64)."""
        ids = self.encode(text)
        # A UTF-8 byte starts a character unless it is a continuation byte (0b10xxxxxx). A lone surrogate
        # is replaced by the one byte '?', so bytes and characters stay in step.
        starts = (ids & 0xC0) != 0x80
        char_index = np.cumsum(starts, dtype=np.int64) - 1
        return ids, char_index

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; ``eod`` is dropped and a cut multi-byte character shows as U+FFFD."""
        data = bytes(int(i) for i in ids if int(i) != self.eod)
        return data.decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"kind": "byte", "name": self.name, "vocab_size": self.vocab_size, "eod": self.eod}


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``, read through the optional ``tokenizers`` package.

    The end-of-document id is ``eod_token`` when given, else the first of ``EOD_CANDIDATES`` that the
    vocabulary contains. Encoding adds no special tokens: the data layer appends ``eod`` itself.
    """

    def __init__(self, path: str | Path, *, eod_token: str | None = None):
        self.path = Path(path).expanduser().resolve()
        if self.path.is_dir():
            self.path = self.path / "tokenizer.json"
        if not self.path.is_file():
            raise DataError(
                f"tokenizer file not found: expected a Hugging Face tokenizer.json at {self.path}",
                hint="pass --tokenizer byte, or --tokenizer PATH/TO/tokenizer.json",
            )
        try:
            import tokenizers
        except ImportError:
            from nam_core.data import missing_package

            raise missing_package("tokenizers", f"reading the Hugging Face tokenizer {self.path}") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust side raises a bare Exception for a malformed file
            raise DataError(
                f"{self.path} is not a readable Hugging Face tokenizer.json: {e}",
                hint="pass the tokenizer.json of a Hugging Face model, or --tokenizer byte",
            ) from e
        # a document is encoded whole and as text: a tokenizer.json may carry truncation or padding settings
        # (they cut documents or write pad ids into the data), and a special token's string inside a document
        # (code that prints "<|endoftext|>") is text, not a document boundary in the middle of it
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = True
        self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        self.name = f"hf-{self.sha256[:12]}"  # content-addressed, so caches keyed by name stay honest
        # ids need not be dense: the largest id, not the count of entries, decides the vocabulary (and the dtype
        # the ids are stored in: a count below 2**16 with an id above it wrapped in uint16)
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        self.eod_token, self.eod = self._find_eod(eod_token)

    def _find_eod(self, eod_token: str | None) -> tuple[str, int]:
        if eod_token is not None:
            eod = self._tok.token_to_id(eod_token)
            if eod is None:
                raise DataError(
                    f"--eod-token {eod_token!r} is not in the vocabulary of {self.path}",
                    hint="pass a token the tokenizer has, e.g. --eod-token '<|endoftext|>'",
                )
            return eod_token, eod
        for token in EOD_CANDIDATES:
            eod = self._tok.token_to_id(token)
            if eod is not None:
                return token, eod
        raise DataError(
            f"{self.path} has none of the end-of-document tokens nam looks for ({', '.join(EOD_CANDIDATES)})",
            hint="name it: nam data prepare SRC --out DIR --tokenizer PATH --eod-token TOKEN",
        )

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(_encodable(text), add_special_tokens=False).ids, dtype=np.int64)

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        enc = self._tok.encode(_encodable(text), add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        # offsets are (start, end) character positions in the Python string; a zero-width token at the
        # very end would point one past the last character, so clamp it onto the last one.
        starts = np.asarray([start for start, _ in enc.offsets], dtype=np.int64).reshape(-1)
        return ids, np.clip(starts, 0, max(len(text) - 1, 0))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict:
        return {
            "kind": "huggingface",
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "eod_token": self.eod_token,
            "path": str(self.path),
            "sha256": self.sha256,
        }


def load_tokenizer(spec: str, *, eod_token: str | None = None) -> Tokenizer:
    """``"byte"`` -> the built-in byte tokenizer; anything else is a path to a ``tokenizer.json`` (or its folder)."""
    if spec == "byte":
        if eod_token is not None:
            raise DataError(
                "--eod-token only applies to a tokenizer.json; the byte tokenizer's eod is always 256",
                hint="drop --eod-token, or pass --tokenizer PATH/TO/tokenizer.json",
            )
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token=eod_token)


def tokenizer_from_description(desc: dict) -> Tokenizer:
    """The tokenizer a dataset manifest describes; a tokenizer.json must still be at its path, unchanged."""
    kind = desc.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "huggingface":
        tok = HFTokenizer(desc["path"], eod_token=desc.get("eod_token"))
        if tok.sha256 != desc.get("sha256"):
            raise DataError(
                f"{tok.path} changed since the dataset was prepared (sha256 {tok.sha256[:12]}, "
                f"the manifest says {str(desc.get('sha256'))[:12]})",
                hint="restore that tokenizer.json, or prepare again: nam data prepare SRC --out PATH --tokenizer FILE",
            )
        return tok
    raise DataError(
        f"unknown tokenizer kind {kind!r} in a dataset manifest (expected 'byte' or 'huggingface')",
        hint="prepare the dataset again with this nam: nam data prepare SRC --out PATH",
    )


def _encodable(text: str) -> str:
    """``text`` with each lone surrogate (valid in JSON, not in UTF-8) as "?", as the byte tokenizer writes it, so
    character offsets still index ``text`` (one character for one); the Rust tokenizer refuses such a string."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
