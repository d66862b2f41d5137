"""Validation (issue 31): held-out splits written by ``nam data prepare --val-fraction`` and read as views of the
dataset (nam_core/data/dataset.py), and ``train.eval_every`` / ``train.eval_tokens`` in the local engine through
``nam train`` (nam_core/engine/validation.py). The megatron engine's evaluation is compared with the local
engine's in tests/test_megatron_engine_gloo.py."""

import json
import textwrap

import numpy as np
import pytest

from nam_cli.main import run
from nam_core.data.dataset import PackedSequences, held_out, open_dataset
from nam_core.engine.metrics import read_metrics


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """20 small documents with distinct text, so a document's tokens say which one it is."""
    folder = tmp_path_factory.mktemp("src")
    for i in range(20):
        (folder / f"doc{i:02d}.py").write_text(f"# document {i:02d}\n" + textwrap.dedent(f"""
            def f{i}(x):
                return x * {i} + {i * 7}
        """) * (1 + i % 3))
    return folder


@pytest.fixture(scope="module")
def split_data(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "ds"
    assert run(["data", "prepare", str(src), "--out", str(out), "--val-fraction", "0.2"]) == 0
    return out


@pytest.mark.parametrize("documents, count", [(20, 4), (7, 3), (266, 8), (5, 4), (3, 0)])
def test_held_out_documents_are_distinct_and_spread(documents, count):
    ids = held_out(documents, count)
    assert len(ids) == len(set(ids.tolist())) == count and np.all(np.diff(ids) > 0)
    assert ids.size == 0 or (ids[0] < documents / count and ids[-1] >= documents - documents / count)


def test_the_splits_partition_the_documents_and_read_their_own_streams(split_data, src):
    whole = open_dataset(split_data)
    assert whole.manifest["validation_documents"] == 4 and whole.documents == 20
    train, val = whole.split("train"), whole.split("validation")
    assert train.documents == 16 and val.documents == 4
    assert train.num_tokens + val.num_tokens == whole.num_tokens
    held = held_out(20, 4).tolist()
    texts = [bytes(val.document(i)[:-1].astype(np.uint8)).decode() for i in range(4)]
    assert texts == [(src / f"doc{j:02d}.py").read_text() for j in held]
    trained = {bytes(train.read(int(a), int(b))[:13].astype(np.uint8)).decode()
               for a, b in zip(train.doc_starts[:-1], train.doc_starts[1:])}
    assert trained == {f"# document {j:02d}" for j in range(20) if j not in held}
    # the stream of a split runs across its own documents' boundaries only
    assert np.array_equal(val.read(0, val.num_tokens), np.concatenate([val.document(i) for i in range(4)]))
    rows = PackedSequences(val, 16, 0)
    assert len(rows) == -(-(val.num_tokens - 1) // 16)


def test_a_dataset_without_the_field_holds_nothing_out(tmp_path, src):
    out = tmp_path / "ds"
    assert run(["data", "prepare", str(src), "--out", str(out)]) == 0
    whole = open_dataset(out)
    assert whole.validation_documents == 0 and whole.split("train").num_tokens == whole.num_tokens
    manifest = json.loads((out / "dataset.json").read_text())
    manifest["validation_documents"] = 20  # every document: nothing left to train on
    (out / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="validation_documents is 20; expected an integer from 0 to 19"):
        open_dataset(out)


def test_a_val_fraction_outside_zero_to_one_is_refused(tmp_path, src, capsys):
    assert run(["data", "prepare", str(src), "--out", str(tmp_path / "ds"), "--val-fraction", "1.0"]) == 2
    assert "--val-fraction 1.0: expected a share of the documents in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "ds").exists()


TRAIN = ["--set", "seq_len=32", "--set", "train.micro_batch_size=2", "--set", "train.checkpoint_every=0"]


@pytest.fixture(scope="module")
def runs(split_data, tmp_path_factory):
    """The same 3 steps with an evaluation after steps 2 and 3 (one held-out micro-batch of 2 x 32, a checkpoint
    at the end) and without: run folders and what each printed."""
    folders = {}
    for name, sets in (("eval", ["train.eval_every=2", "train.eval_tokens=64", "train.checkpoint_every=3"]),
                       ("plain", [])):
        folders[name] = tmp_path_factory.mktemp(name) / "run"
        args = [a for s in sets for a in ("--set", s)]
        assert run(["train", "--run-dir", str(folders[name]), "--data", str(split_data), "--max-steps", "3",
                    *TRAIN, *args]) == 0
    return folders


def test_local_engine_evaluates_every_n_steps_and_at_the_end(runs):
    metrics = read_metrics(runs["eval"])
    assert [m["step"] for m in metrics if "val_loss" in m] == [2, 3]
    vals = [m["val_loss"] for m in metrics if "val_loss" in m]
    assert all(np.isfinite(vals)) and vals[-1] < vals[0]  # the held-out LM loss falls from step 2 to step 3
    summary = json.loads((runs["eval"] / "summary.json").read_text())
    assert summary["val_loss_last"] == vals[-1] and summary["val_loss_step"] == 3


def test_the_progress_line_and_the_summary_line_show_it(capsys):
    from nam_core.engine.metrics import MetricsLog
    from nam_core.engine.summary import describe, summarize

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        log = MetricsLog(Path(tmp), start_step=0, total_steps=1)
        log.log({"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "val_loss": 1.23456})
        log.close()
    assert "step 1 LM loss 2.0000 lr 1.00e-03 grad_norm 1.000 tok/s 10 val_loss 1.2346" in capsys.readouterr().err
    records = [{"step": 1, "loss": 2.0, "lm_loss": 2.0}, {"step": 2, "loss": 1.5, "lm_loss": 1.5, "val_loss": 1.7}]
    line = describe(dict(summarize(records, wall_s=1.0, steps_run=2, tokens_per_step=8), run_dir="r"))
    assert "validation LM loss 1.7000 at step 2" in line


def test_evaluation_does_not_change_training(runs):
    """With and without evaluation: the same training losses and gradient norms, bit for bit (the evaluation
    takes no gradient, draws no random number and leaves the model in train mode)."""
    assert [(m["loss"], m["grad_norm"]) for m in read_metrics(runs["eval"])] == \
           [(m["loss"], m["grad_norm"]) for m in read_metrics(runs["plain"])]


def test_val_loss_is_the_lm_loss_of_the_held_out_rows(runs, split_data):
    """eval_tokens 64 at micro-batch 2 x 32 is one micro-batch: held-out batch 0. Its LM loss from the final
    checkpoint's weights, recomputed here, is the logged val_loss (float32, the same forward: to rounding)."""
    import torch

    from nam56r.model import build_model
    from nam56r.recipes import get_recipe
    from nam_core.engine import checkpoint

    logged = read_metrics(runs["eval"])[-1]["val_loss"]
    model = build_model(get_recipe("nam56r-tiny").model.replace(seq_len=32))
    model.load_state_dict(checkpoint.model_state(runs["eval"] / "checkpoints" / "step-00000003")[0])
    model.eval()
    rows = PackedSequences(open_dataset(split_data).split("validation"), 32, get_recipe("nam56r-tiny").train.seed)
    batch = {k: v for k, v in rows.batch_at(0, 2).items() if k != "positions"}
    with torch.no_grad():
        expected = model(**batch)["lm_loss"].item()
    assert logged == pytest.approx(expected, rel=1e-6)


def test_evaluating_without_held_out_data_is_refused_before_training(tmp_path, src, capsys):
    plain = tmp_path / "plain"
    assert run(["data", "prepare", str(src), "--out", str(plain)]) == 0
    run_dir = tmp_path / "run"
    assert run(["train", "--run-dir", str(run_dir), "--data", str(plain), "--max-steps", "1", *TRAIN,
                "--set", "train.eval_every=1"]) == 4
    err = capsys.readouterr().err
    assert "train.eval_every=1 needs held-out data" in err and "--val-fraction 0.01" in err and "--eval-data" in err
    assert not (run_dir / "metrics.jsonl").exists()


def test_eval_data_is_a_dataset_of_its_own(tmp_path, src, split_data):
    other = tmp_path / "other"
    assert run(["data", "prepare", str(src), "--out", str(other)]) == 0
    run_dir = tmp_path / "run"
    assert run(["train", "--run-dir", str(run_dir), "--data", str(split_data), "--eval-data", str(other),
                "--max-steps", "1", *TRAIN, "--set", "train.eval_every=1", "--set", "train.eval_tokens=64"]) == 0
    assert np.isfinite(read_metrics(run_dir)[-1]["val_loss"])


def test_held_out_rows_too_few_for_one_micro_batch_are_refused():
    from nam_core.engine.validation import HeldOut
    from nam_core.errors import DataError

    held = HeldOut(batch_at=lambda i, b: {}, rows=3, seq_len=32, source="x")
    assert held.micro_batches(eval_tokens=10_000, micro_batch_size=1, dp=2) == 1  # one pass at most: 3 // 2
    assert held.micro_batches(eval_tokens=64, micro_batch_size=1) == 2  # ceil(64 / 32)
    with pytest.raises(DataError, match="one evaluation micro-batch on each of 2 data-parallel rank"):
        held.micro_batches(eval_tokens=64, micro_batch_size=2, dp=2)
