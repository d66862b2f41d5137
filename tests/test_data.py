"""The data layer: tokenizers, atomic preparation, manifest checks, packed rows and their order."""

from __future__ import annotations

import json
import os
import sys
import time
import types

import numpy as np
import pytest
import torch

from nam_core.data import prepare as prepare_module
from nam_core.data.dataset import PackedSequences, open_dataset
from nam_core.data.prepare import build_stdlib_corpus, prepare, stdlib_files
from nam_core.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from nam_core.errors import ConfigError, DataError

BYTE = ByteTokenizer()


def fake_structure(text: str) -> list[int]:
    """Stand-in for nam56r.blocks.structure.char_structure_ids: 1 letters, 2 digits, 3 other non-space."""
    return [1 if c.isalpha() else 2 if c.isdigit() else 0 if c.isspace() else 3 for c in text]


def no_leftovers(out) -> bool:
    """Neither ``out`` nor any temp/old sibling of it exists."""
    return not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(out.name + ".")]


def write_jsonl(path, texts) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


@pytest.fixture
def code_folder(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text('def f(x):\n    return "héllo €" + str(x)\n', encoding="utf-8")
    (src / "pkg" / "b.txt").write_text("plain text 123\n", encoding="utf-8")
    (src / "c.bin").write_bytes(b"\x00\x01\x02binary")
    (src / "d.txt").write_bytes(b"\xff\xfe latin-1 \xe9")
    (src / "e.txt").write_bytes(b"")
    (src / ".hidden").mkdir()
    (src / ".hidden" / "x.py").write_text("not read\n")
    return src


def test_byte_tokenizer_offsets_and_round_trip():
    text = "aé€\n"
    ids, char_index = BYTE.encode_with_offsets(text)
    assert ids.tolist() == list(text.encode()) == [97, 195, 169, 226, 130, 172, 10]
    assert char_index.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert BYTE.decode(list(ids) + [BYTE.eod]) == text
    assert (BYTE.vocab_size, BYTE.eod) == (257, 256)
    assert load_tokenizer("byte").describe() == {"kind": "byte", "name": "byte", "vocab_size": 257, "eod": 256}


def test_prepare_folder_round_trip_and_structure(code_folder, tmp_path):
    out = tmp_path / "ds"
    summary = prepare(code_folder, out, BYTE, annotate=fake_structure, progress=False)
    texts = [(code_folder / "a.py").read_text("utf-8"), (code_folder / "pkg" / "b.txt").read_text("utf-8")]
    assert summary.documents == 2
    assert summary.files_read == 2 and summary.files_skipped == 3
    assert summary.skipped == {"binary": 1, "not_utf8": 1, "empty_file": 1}
    assert summary.tokens == sum(len(t.encode()) + 1 for t in texts)
    assert sorted(p.name for p in out.iterdir()) == [
        ".nam-verified.json", "dataset.json", "structure.bin", "structure.idx", "tokens.bin", "tokens.idx"]

    ds = open_dataset(out)
    assert ds.documents == 2 and ds.has_structure and ds.max_token_id == 256
    for i, text in enumerate(texts):  # sorted by path: a.py, then pkg/b.txt
        ids = ds.document(i)
        assert ids[-1] == BYTE.eod and BYTE.decode(ids) == text
        struct = ds.document(i, structure=True)
        assert len(struct) == len(ids) and struct[-1] == 0
        _, char_index = BYTE.encode_with_offsets(text)
        assert struct[:-1].tolist() == [fake_structure(text)[c] for c in char_index]
    # the 3-byte euro sign: three tokens, all with the id of that one character (3: "other")
    euro = texts[0].encode().index("€".encode())
    assert ds.document(0, structure=True)[euro:euro + 3].tolist() == [3, 3, 3]
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["tokenizer"] == BYTE.describe() and manifest["structure"]["present"] is True


def test_prepare_jsonl_and_missing_text_names_the_line(tmp_path):
    src = tmp_path / "docs.jsonl"
    write_jsonl(src, ["first doc", "second ✓ doc"])
    summary = prepare(src, tmp_path / "ok", BYTE, progress=False)
    ds = open_dataset(tmp_path / "ok")
    assert summary.documents == 2 and not ds.has_structure
    assert [BYTE.decode(ds.document(i)) for i in range(2)] == ["first doc", "second ✓ doc"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n\n{"content": "b"}\n', encoding="utf-8")
    out = tmp_path / "bad-out"
    with pytest.raises(DataError, match=r"bad\.jsonl:3: expected a JSON object with a string field 'text'") as e:
        prepare(bad, out, BYTE, progress=False)
    assert "content" in e.value.message and e.value.exit_code == 4
    assert no_leftovers(out)


def test_parquet_without_pyarrow_is_a_data_error(tmp_path, monkeypatch):
    shard = tmp_path / "shard.parquet"
    shard.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match="pyarrow") as e:
        prepare(shard, tmp_path / "out", BYTE, progress=False)
    assert e.value.hint.startswith("pip install pyarrow ") and "'.[data]'" in e.value.hint
    assert no_leftovers(tmp_path / "out")


def test_parquet_token_shards(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3], [4, 5, 256]]}), shards / "0.parquet")
    summary = prepare(shards, tmp_path / "ds", BYTE, annotate=fake_structure, progress=False)
    ds = open_dataset(tmp_path / "ds")
    # eod appended to the first row; the second already ends with it
    assert [ds.document(i).tolist() for i in range(2)] == [[1, 2, 3, 256], [4, 5, 256]]
    assert not summary.structure and not ds.has_structure
    assert "no text" in ds.manifest["structure"]["note"]

    pq.write_table(pa.table({"tokens": [[1, 999]]}), shards / "0.parquet")
    with pytest.raises(DataError, match="999"):
        prepare(shards, tmp_path / "ds2", BYTE, progress=False)


def test_hf_tokenizer_without_package_is_a_data_error(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(DataError) as e:
        load_tokenizer(str(path))
    assert e.value.hint.startswith("pip install tokenizers ") and "'.[data]'" in e.value.hint
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_hf_tokenizer_prepares_with_offsets(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "def": 2, "f": 3, "():": 4, "return": 5, "1": 6, "é": 7, "x": 8}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))

    hf = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert isinstance(hf, HFTokenizer) and hf.eod == 1 and hf.vocab_size == 9
    text = "é def f():  return 1"
    ids, starts = hf.encode_with_offsets(text)
    assert ids.tolist() == [7, 2, 3, 4, 5, 6]
    assert starts.tolist() == [0, 2, 6, 7, 12, 19]  # characters, not bytes ("é" is 2 bytes)
    write_jsonl(tmp_path / "d.jsonl", [text])
    prepare(tmp_path / "d.jsonl", tmp_path / "ds", hf, annotate=fake_structure, progress=False)
    ds = open_dataset(tmp_path / "ds")
    assert ds.document(0).tolist() == [7, 2, 3, 4, 5, 6, 1]
    assert ds.document(0, structure=True).tolist() == [1, 1, 1, 3, 1, 2, 0]
    assert ds.manifest["tokenizer"]["eod_token"] == "<|endoftext|>"

    with pytest.raises(DataError, match="--eod-token"):
        load_tokenizer(str(tmp_path / "tokenizer.json"), eod_token="<nope>")


def test_hf_tokenizer_encodes_each_document_whole_and_as_text(tmp_path):
    """A tokenizer.json saved with truncation and padding on encodes a document whole and without pad ids; the
    end-of-document token's string inside a document is text (not a boundary); a lone surrogate (valid JSON) is
    "?" as the byte tokenizer makes it, not a crash; ids above the count of entries size the vocabulary."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "a": 2, "b": 3, "?": 4, "<": 5, "|": 6, ">": 7, "endoftext": 8,
             "far": 70000}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    pre = tokenizers.pre_tokenizers
    tok.pre_tokenizer = pre.Sequence([pre.WhitespaceSplit(), pre.Punctuation()])
    tok.add_special_tokens(["<|endoftext|>"])
    tok.enable_truncation(max_length=2)
    tok.enable_padding(length=12, pad_id=1, pad_token="<|endoftext|>")
    tok.save(str(tmp_path / "tokenizer.json"))

    hf = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert hf.encode("a b a b a").tolist() == [2, 3, 2, 3, 2]  # whole, no pad ids
    assert hf.encode("a <|endoftext|> b").tolist() == [2, 5, 6, 8, 6, 7, 3]  # no eod (1) inside
    ids, starts = hf.encode_with_offsets("a \ud800b")
    assert ids.tolist() == [2, 4, 3] and starts.tolist() == [0, 2, 3]
    assert hf.vocab_size == 70001 and hf.encode("far").tolist() == [70000]


def test_open_dataset_refuses_damage(code_folder, tmp_path):
    out = tmp_path / "ds"
    prepare(code_folder, out, BYTE, progress=False)
    idx = out / "tokens.idx"
    good = idx.read_bytes()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    idx.write_bytes(bytes(flipped))
    with pytest.raises(DataError, match="tokens.idx is corrupt") as e:
        open_dataset(out)
    assert e.value.hint == f"nam data prepare SRC --out {out} --overwrite" and e.value.exit_code == 4

    idx.write_bytes(good)
    open_dataset(out)  # restored: opens again
    with open(out / "tokens.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataError, match="tokens.bin has"):
        open_dataset(out)

    (out / "dataset.json").write_text("{not json")
    with pytest.raises(DataError, match="dataset.json is not a readable JSON manifest"):
        open_dataset(out)
    with pytest.raises(DataError, match="no prepared dataset") as e:
        open_dataset(tmp_path / "nowhere")
    assert e.value.hint.startswith("nam data prepare SRC --out")


def test_check_vocab(code_folder, tmp_path):
    prepare(code_folder, tmp_path / "ds", BYTE, progress=False)
    ds = open_dataset(tmp_path / "ds")
    ds.check_vocab(257)  # ids 0..256 fit
    with pytest.raises(DataError, match="token id 256 but the model's vocabulary has 256") as e:
        ds.check_vocab(256)
    assert "vocab_size to at least 257" in e.value.hint


@pytest.fixture
def packed_source(tmp_path):
    """Three documents of 5, 3 and 9 tokens (eod included): a 17-token stream."""
    texts = ["abcd", "xy", "01234567"]
    write_jsonl(tmp_path / "d.jsonl", texts)
    prepare(tmp_path / "d.jsonl", tmp_path / "ds", BYTE, annotate=fake_structure, progress=False)
    stream = np.concatenate([np.append(BYTE.encode(t), BYTE.eod) for t in texts])
    return open_dataset(tmp_path / "ds"), stream


def test_packed_rows_are_contiguous_shifted_slices(packed_source):
    ds, stream = packed_source
    seq = 4
    packed = PackedSequences(ds, seq_len=seq, seed=0)
    assert len(stream) == 17 and len(packed) == 4  # ceil((17 - 1) / 4)
    for i in range(len(packed)):
        row = packed.row(i)
        window = np.append(stream[i * seq: i * seq + seq + 1], [BYTE.eod] * 5)[: seq + 1]
        assert row["tokens"].tolist() == window[:-1].tolist()
        assert row["labels"].tolist() == window[1:].tolist()
        assert row["loss_mask"].tolist() == [1.0] * seq  # 16 labels fill 4 rows exactly: no padding
    assert ds.read(0, 17).tolist() == stream.tolist()

    packed5 = PackedSequences(ds, seq_len=5, seed=0)  # 16 labels -> 4 rows, the last with 1 real label
    last = packed5.row(3)  # stream[15:17] = "7", eod; then padding
    assert last["tokens"].tolist() == [55, 256, 256, 256, 256]
    assert last["labels"].tolist() == [256, 256, 256, 256, 256]
    assert last["loss_mask"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_segments_and_positions_across_a_boundary(packed_source):
    ds, stream = packed_source
    packed = PackedSequences(ds, seq_len=6, seed=0)
    row = packed.row(0)  # stream positions 0..5 as inputs: "abcd<eod>x"
    assert row["tokens"].tolist() == [97, 98, 99, 100, 256, 120]
    assert row["segment_ids"].tolist() == [0, 0, 0, 0, 0, 1]
    assert row["positions"].tolist() == [0, 1, 2, 3, 4, 0]
    assert row["structure"].tolist() == [1, 1, 1, 1, 0, 1]
    row = packed.row(2)  # inputs at 12..16 then one pad; labels 13..16 then two pads
    assert row["tokens"].tolist() == [52, 53, 54, 55, 256, 256]
    assert row["segment_ids"].tolist() == [0, 0, 0, 0, 0, 1]
    assert row["positions"].tolist() == [4, 5, 6, 7, 8, 0]
    assert row["loss_mask"].tolist() == [1, 1, 1, 1, 0, 0]
    assert row["structure"].tolist() == [2, 2, 2, 2, 0, 0]


def test_batch_order_is_a_pure_function_of_seed_and_step(packed_source):
    ds, _ = packed_source
    a = PackedSequences(ds, seq_len=2, seed=7)  # 8 rows
    b = PackedSequences(ds, seq_len=2, seed=7)  # a resumed run: a fresh object, same seed
    assert len(a) == 8
    for key, value in a.batch_at(5, 3).items():
        assert value.shape == (3, 2) and torch.equal(value, b.batch_at(5, 3)[key])
    assert a.batch_at(0, 2)["tokens"].dtype == torch.int64 and a.batch_at(0, 2)["loss_mask"].dtype == torch.float32

    # one epoch visits every row once; the next epoch uses a different permutation
    epoch0 = [a.batch_at(step, 2)["tokens"] for step in range(4)]
    rows0 = sorted(tuple(r.tolist()) for t in epoch0 for r in t)
    assert rows0 == sorted(tuple(a.row(i)["tokens"].tolist()) for i in range(8))
    assert a.epoch_at(4, 2) == 1 and not np.array_equal(a.permutation(0), a.permutation(1))

    orders = {seed: PackedSequences(ds, seq_len=2, seed=seed).permutation(0).tolist() for seed in range(4)}
    assert len({tuple(o) for o in orders.values()}) > 1


def test_failed_prepare_leaves_nothing(code_folder, tmp_path, monkeypatch):
    out = tmp_path / "ds"
    calls = []

    def encode_then_fail(text):
        calls.append(text)
        if len(calls) == 2:
            raise RuntimeError("injected failure mid-way")
        return BYTE.encode(text)

    monkeypatch.setattr(BYTE, "encode", encode_then_fail)
    with pytest.raises(RuntimeError, match="injected"):
        prepare(code_folder, out, BYTE, progress=False)
    assert len(calls) == 2 and no_leftovers(out)
    monkeypatch.undo()

    # an existing dataset is refused, kept intact by a failing overwrite, and replaced by a good one
    prepare(code_folder, out, BYTE, progress=False)
    with pytest.raises(ConfigError, match="exists and is not empty") as e:
        prepare(code_folder, out, BYTE, progress=False)
    assert "--overwrite" in e.value.hint
    before = (out / "dataset.json").read_text()
    monkeypatch.setattr(prepare_module, "file_sha256", lambda p: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        prepare(code_folder, out, BYTE, overwrite=True, progress=False)
    assert (out / "dataset.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ds")] == ["ds"]
    monkeypatch.undo()
    summary = prepare(code_folder, out, BYTE, annotate=fake_structure, overwrite=True, progress=False)
    assert summary.structure and open_dataset(out).has_structure


def test_out_inside_source_is_not_read(code_folder):
    out = code_folder / "prepared"
    prepare(code_folder, out, BYTE, progress=False)
    summary = prepare(code_folder, out, BYTE, overwrite=True, progress=False)
    assert summary.documents == 2  # the dataset folder was not walked as a source


def test_stdlib_corpus_builds_once(tmp_path):
    files = stdlib_files(max_files=20)
    assert len(files) == 20 and all(f.suffix == ".py" for f in files)
    assert not any(part in {"test", "tests", "idlelib", "lib2to3", "site-packages"} for f in files for part in f.parts)

    started = time.perf_counter()
    out = build_stdlib_corpus(tmp_path, BYTE, fake_structure, max_files=20)
    first = time.perf_counter() - started
    manifest = out / "dataset.json"
    stamp = manifest.stat().st_mtime_ns
    ds = open_dataset(out)
    assert out.name == f"stdlib-byte-py{sys.version_info.major}{sys.version_info.minor}"
    assert ds.has_structure and 0 < ds.documents <= 20 and ds.num_tokens > 1000

    started = time.perf_counter()
    assert build_stdlib_corpus(tmp_path, BYTE, fake_structure, max_files=20) == out
    assert manifest.stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert time.perf_counter() - started < max(first, 0.5)

    # a different cap is a different corpus: rebuilt in place
    build_stdlib_corpus(tmp_path, BYTE, fake_structure, max_files=10)
    assert open_dataset(out).manifest["source"]["max_files"] == 10


# ----------------------------------------------------------------------------------------- CLI


@pytest.fixture
def structure_module(monkeypatch):
    """``nam56r.blocks.structure`` with the stand-in annotator, whether or not the real module exists yet."""
    module = types.ModuleType("nam56r.blocks.structure")
    module.char_structure_ids = fake_structure
    monkeypatch.setitem(sys.modules, "nam56r.blocks.structure", module)
    import nam56r.blocks

    monkeypatch.setattr(nam56r.blocks, "structure", module, raising=False)
    return module


def test_cli_prepare_and_inspect_json(code_folder, tmp_path, structure_module):
    from typer.testing import CliRunner

    from nam_cli.data import app

    runner = CliRunner()
    out = tmp_path / "ds"
    result = runner.invoke(app, ["prepare", str(code_folder), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["documents"] == 2 and summary["structure"] is True

    result = runner.invoke(app, ["inspect", str(out), "--json", "--sample", "9"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["documents"] == 2 and info["vocab_size"] == 257 and info["structure"]["present"]
    assert info["sample"]["text"] == "def f(x):"

    result = runner.invoke(app, ["inspect", str(out), "--sample", "9"])
    assert result.exit_code == 0 and "def f(x):" in result.stdout and "documents  2" in result.stdout

    # NamErrors propagate to nam's main, which prints them and sets the exit code
    result = runner.invoke(app, ["prepare", str(code_folder), "--out", str(out), "--no-structure"])
    assert isinstance(result.exception, ConfigError) and result.exception.exit_code == 2  # a command-line choice


# ----------------------------------------------------------------------------------------- integrity


def flip_byte(path, at=None) -> None:
    """Flip one byte of ``path`` in place: same size, new content."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_a_bin_are_caught_even_after_a_clean_open(code_folder, tmp_path):
    out = tmp_path / "ds"
    prepare(code_folder, out, BYTE, annotate=fake_structure, progress=False)
    manifest = json.loads((out / "dataset.json").read_text())
    assert set(manifest["sha256"]) == {"tokens.bin", "tokens.idx", "structure.bin", "structure.idx"}
    first = open_dataset(out)
    assert first.integrity["tokens.bin"]["hashed"] is False  # prepare stamped it: the first open reads no byte
    assert open_dataset(out, verify_all=True).integrity["tokens.bin"]["hashed"] is True

    before = (out / "tokens.bin").stat()
    flip_byte(out / "tokens.bin")
    os.utime(out / "tokens.bin", ns=(before.st_atime_ns, before.st_mtime_ns))  # even with its mtime put back
    with pytest.raises(DataError, match=r"tokens\.bin is corrupt or was changed since it was prepared") as e:
        open_dataset(out)
    assert e.value.exit_code == 4 and e.value.hint == f"prepare it again: nam data prepare SRC --out {out} --overwrite"

    flip_byte(out / "tokens.bin")  # flipped back: good again, and re-stamped
    assert open_dataset(out).integrity["tokens.bin"]["hashed"] is True
    assert open_dataset(out).integrity["tokens.bin"]["hashed"] is False
    flip_byte(out / "structure.bin", at=0)
    with pytest.raises(DataError, match=r"structure\.bin is corrupt"):
        open_dataset(out)


def test_ids_above_the_manifest_are_a_data_error_not_an_index_error(code_folder, tmp_path):
    """A .bin whose checksum was recomputed by hand still cannot smuggle in an id past the vocabulary."""
    from nam_core.data.integrity import file_sha256

    out = tmp_path / "ds"
    prepare(code_folder, out, BYTE, progress=False)
    tokens = np.fromfile(out / "tokens.bin", dtype=np.uint16)
    tokens[3] = 300
    tokens.tofile(out / "tokens.bin")
    manifest = json.loads((out / "dataset.json").read_text())
    manifest["sha256"]["tokens.bin"] = file_sha256(out / "tokens.bin")
    (out / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"tokens\.bin holds token id 300, above the largest its dataset\.json "
                                        r"records \(256\)") as e:
        open_dataset(out)
    assert e.value.exit_code == 4


def test_a_dataset_without_bin_checksums_is_refused_until_they_are_recorded(code_folder, tmp_path):
    from typer.testing import CliRunner

    from nam_cli.data import app

    out = tmp_path / "ds"
    prepare(code_folder, out, BYTE, annotate=fake_structure, progress=False)
    manifest = json.loads((out / "dataset.json").read_text())
    for name in ("tokens.bin", "structure.bin"):
        del manifest["sha256"][name]  # the manifest of a nam from before .bin checksums
    (out / "dataset.json").write_text(json.dumps(manifest))
    (out / ".nam-verified.json").unlink()
    with pytest.raises(DataError, match="older nam: its dataset.json has no checksum of tokens.bin") as e:
        open_dataset(out)
    assert f"nam data checksum {out}" in e.value.hint and "--overwrite" in e.value.hint

    result = CliRunner().invoke(app, ["checksum", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["sha256"]) == {"tokens.bin", "structure.bin"}
    assert open_dataset(out).integrity["tokens.bin"]["hashed"] is False  # checksum stamped what it hashed

    # a .bin whose checksum is recorded is checked against it, never recorded again: a changed one stays refused
    assert CliRunner().invoke(app, ["checksum", str(out), "--json"]).exit_code == 0  # nothing missing, all match
    flip_byte(out / "tokens.bin")
    result = CliRunner().invoke(app, ["checksum", str(out)])
    assert isinstance(result.exception, DataError) and "tokens.bin is corrupt or was changed" in str(result.exception)
    with pytest.raises(DataError, match="tokens.bin is corrupt or was changed"):
        open_dataset(out)


def test_inspect_verify_rehashes_and_reports_json(code_folder, tmp_path):
    from typer.testing import CliRunner

    from nam_cli.data import app

    out = tmp_path / "ds"
    prepare(code_folder, out, BYTE, progress=False)
    runner = CliRunner()
    plain = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)["checksums"]["tokens.bin"]
    assert plain["ok"] and plain["hashed"] is False
    result = runner.invoke(app, ["inspect", str(out), "--verify", "--json"])
    assert result.exit_code == 0, result.output
    verified = json.loads(result.stdout)["checksums"]["tokens.bin"]
    assert verified["hashed"] is True and verified["sha256"] == plain["sha256"]

    flip_byte(out / "tokens.bin")
    result = runner.invoke(app, ["inspect", str(out), "--verify"])
    assert isinstance(result.exception, DataError) and "tokens.bin is corrupt" in result.exception.message


def test_stamp_of_a_read_only_folder_goes_to_the_cache(code_folder, tmp_path, monkeypatch):
    from nam_core.data import integrity

    out = tmp_path / "ds"
    prepare(code_folder, out, BYTE, progress=False)
    (out / ".nam-verified.json").unlink()
    monkeypatch.setenv("NAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(integrity.os, "access", lambda path, mode: False)  # as if read-only (tests run as root)
    assert open_dataset(out).integrity["tokens.bin"]["hashed"] is True
    assert open_dataset(out).integrity["tokens.bin"]["hashed"] is False
    assert len(list((tmp_path / "cache" / "verified").iterdir())) == 1 and not (out / ".nam-verified.json").exists()


# ----------------------------------------------------------------------------------------- leftovers


def dead_pid() -> int:
    """A pid that belongs to no process: a child that has exited and been reaped."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_a_killed_prepare_are_removed_by_the_next(code_folder, tmp_path, capsys):
    out = tmp_path / "ds"
    dead = dead_pid()
    for name in (f"ds.tmp-{dead}", f"ds.tmp-{os.getppid()}"):  # a killed prepare's, and a live process's
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokens.bin").write_bytes(b"half")
    summary = prepare(code_folder, out, BYTE, progress=False)
    assert not (tmp_path / f"ds.tmp-{dead}").exists() and (tmp_path / f"ds.tmp-{os.getppid()}").exists()
    assert summary.cleaned == [f"removed {tmp_path / f'ds.tmp-{dead}'}, left by a prepare (pid {dead}) that was killed"]
    assert f"note: removed {tmp_path / f'ds.tmp-{dead}'}" in capsys.readouterr().err


def test_a_prepare_killed_mid_replace_gets_its_old_dataset_back(code_folder, tmp_path):
    """Killed between renaming the old dataset aside and the new one in: the old one is the only copy."""
    out = tmp_path / "ds"
    prepare(code_folder, out, BYTE, progress=False)
    dead = dead_pid()
    out.rename(tmp_path / f"ds.old-{dead}")
    with pytest.raises(ConfigError, match="exists and is not empty"):  # restored, so not overwritten silently
        prepare(code_folder, out, BYTE, progress=False)
    assert open_dataset(out).documents == 2 and not (tmp_path / f"ds.old-{dead}").exists()


def test_sigterm_while_preparing_exits_through_python(monkeypatch):
    """So the except-clause of the writer removes its temp folder (SIGKILL is left to the next prepare)."""
    import signal

    from nam_cli.data import _sigterm_as_exit

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e, _sigterm_as_exit():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) == before


# ----------------------------------------------------------------------------------------- text parquet


def test_text_parquet_is_tokenized_like_jsonl(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = ["def f():\n    return 1\n", "", None, "second ✓ doc"]
    pq.write_table(pa.table({"id": [1, 2, 3, 4], "text": texts}), tmp_path / "t.parquet")
    write_jsonl(tmp_path / "t.jsonl", [t for t in texts if t])
    a = prepare(tmp_path / "t.parquet", tmp_path / "a", BYTE, annotate=fake_structure, progress=False)
    prepare(tmp_path / "t.jsonl", tmp_path / "b", BYTE, annotate=fake_structure, progress=False)
    pa_ds, js_ds = open_dataset(tmp_path / "a"), open_dataset(tmp_path / "b")
    assert a.source_kind == "parquet-text" and a.documents == 2 and a.skipped == {"empty_record": 2}
    assert pa_ds.has_structure
    for i in range(2):
        assert pa_ds.document(i).tolist() == js_ds.document(i).tolist()
        assert pa_ds.document(i, structure=True).tolist() == js_ds.document(i, structure=True).tolist()

    # a folder of text parquet and code files is one text corpus
    folder = tmp_path / "mixed"
    folder.mkdir()
    pq.write_table(pa.table({"text": ["x = 1\n"]}), folder / "a.parquet")
    (folder / "b.py").write_text("y = 2\n")
    assert prepare(folder, tmp_path / "c", BYTE, progress=False).source_kind == "parquet-text+text"


def test_parquet_without_a_known_column_names_what_it_expects(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"content": ["a"], "lang": ["py"]}), tmp_path / "c.parquet")
    with pytest.raises(DataError) as e:
        prepare(tmp_path / "c.parquet", tmp_path / "out", BYTE, progress=False)
    assert ("expected a list-of-int column 'tokens' or 'input_ids' (token ids) or a string column 'text' "
            "(text, tokenized with --tokenizer), found columns ['content', 'lang']") in e.value.message
    assert "'text'" in e.value.hint and no_leftovers(tmp_path / "out")

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet row 0: column 'text' holds int, expected a string"):
        prepare(tmp_path / "n.parquet", tmp_path / "out", BYTE, progress=False)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet is not a readable parquet file"):
        prepare(tmp_path / "bad.parquet", tmp_path / "out", BYTE, progress=False)
    assert no_leftovers(tmp_path / "out")


# --- a real full or read-only disk (tmpfs: needs root, skipped elsewhere with the reason) -----------------


def test_prepare_on_a_real_full_disk_is_exit_6_naming_the_disk_and_leaves_nothing(tmp_path, small_disk, capsys):
    """~1.5 MB of source is ~3 MB of tokens (uint16) on a 1 MB tmpfs: the kernel's short write mid-file."""
    from nam_cli.main import run

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng()
    for i in range(3):
        (src / f"f{i}.txt").write_text("".join(rng.choice(list("abcdefgh \n"), 500_000)), encoding="utf-8")
    disk = small_disk(1)
    out = disk / "ds"
    assert run(["data", "prepare", str(src), "--out", str(out), "--no-structure", "--json"]) == 6
    err = capsys.readouterr().err
    assert f"no space left on {disk} writing the dataset folder {out}" in err and "source 1 MB" in err, err
    assert "half-written folder was removed" in err and "Traceback" not in err
    assert list(disk.iterdir()) == []  # no ds.tmp-PID left


def test_prepare_onto_a_read_only_disk_is_exit_6_before_anything_is_read(code_folder, small_disk, capsys):
    from nam_cli.main import run

    disk = small_disk(1, read_only=True)
    assert run(["data", "prepare", str(code_folder), "--out", str(disk / "sub" / "ds"), "--json"]) == 6
    err = capsys.readouterr().err
    assert f"cannot write the dataset folder {disk / 'sub' / 'ds'}: {disk} is on a read-only filesystem" in err
    assert "Traceback" not in err and list(disk.iterdir()) == []


def test_prepare_into_a_folder_this_user_may_not_write_is_exit_6_naming_it(code_folder, tmp_path, monkeypatch,
                                                                            capsys):
    from nam_cli.main import run

    parent = tmp_path / "locked"  # as root (CI) chmod is out of reach: what the kernel would answer
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(parent) else real_access(p, m))
    assert run(["data", "prepare", str(code_folder), "--out", str(parent / "ds"), "--json"]) == 6
    err = capsys.readouterr().err
    assert f"cannot write the dataset folder {parent / 'ds'}: permission denied on {parent}" in err, err
    assert f"make {parent} writable" in err and "Traceback" not in err and list(parent.iterdir()) == []


def test_the_default_corpus_under_a_read_only_home_is_exit_6_naming_nam_cache_dir(small_disk, monkeypatch):
    from nam_core.errors import RunFolderError

    disk = small_disk(1, read_only=True)
    with pytest.raises(RunFolderError, match=r"default corpus cannot be prepared in nam's cache: cannot write the "
                                             r"dataset folder .* read-only filesystem") as info:
        build_stdlib_corpus(disk / ".cache" / "nam", BYTE, None, max_files=2)
    assert "NAM_CACHE_DIR" in info.value.hint and "--data DIR" in info.value.hint
    assert list(disk.iterdir()) == []


def test_a_stamp_made_under_another_dtype_does_not_answer_for_this_one(tmp_path):
    """A manifest with a wrong token_dtype (then fixed) must not leave a stamp whose largest id is read under
    the wrong dtype: 40000 as int16 is -25536, and that stamp would pass ids past any vocabulary."""
    from nam_core.data import integrity

    ids = np.random.default_rng().integers(0, 30000, 1000).astype(np.uint16)
    ids[np.random.default_rng().integers(1000)] = 40000
    (tmp_path / "tokens.bin").write_bytes(ids.tobytes())
    digest = integrity.file_sha256(tmp_path / "tokens.bin")
    wrong = integrity.verify(tmp_path, "tokens.bin", digest, np.dtype("int16"))
    assert wrong["hashed"] and wrong["max"] == int(ids.astype(np.int16).max()) < 32768
    right = integrity.verify(tmp_path, "tokens.bin", digest, np.dtype("uint16"))
    assert right["hashed"] and right["max"] == 40000
    again = integrity.verify(tmp_path, "tokens.bin", digest, np.dtype("uint16"))
    assert not again["hashed"] and again["max"] == 40000  # the stamp answers for the dtype it was read as
