"""``nam export`` (cli/export.py) and ``nam56r.export``: a local-engine checkpoint -> safetensors + config.json +
tokenizer, loaded back with nam56r alone, bit for bit; fail-closed without safetensors, on a changed file, for a
torn megatron-engine checkpoint and for a folder that is none. (A megatron-engine export continued by the local
engine: tests/test_megatron_engine_gloo.py.)"""

import json
import sys
import textwrap

import pytest
import torch

from nam_cli.main import run
from nam_core.engine import checkpoint
from nam56r.testing import prepare_corpus

pytest.importorskip("safetensors", reason="nam's export extra (in the test extra: CI has it)")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step nam56r-tiny run (seq 32) with its checkpoint at step 2."""
    corpus = prepare_corpus(tmp_path_factory, (textwrap,), chars=4000)
    run_dir = tmp_path_factory.mktemp("run") / "run"
    assert run(["train", "--run-dir", str(run_dir), "--data", str(corpus), "--max-steps", "2", "--set", "seq_len=32",
                "--set", "train.micro_batch_size=2", "--set", "train.checkpoint_every=2", "-q"]) == 0
    return run_dir


def test_export_loads_back_bit_exact(trained, tmp_path, capsys):
    from nam56r.export import load
    from nam56r.model import build_model
    from nam56r.recipes import get_recipe

    out = tmp_path / "export"
    assert run(["export", str(trained), "--out", str(out)]) == 0  # a run folder: its newest good checkpoint
    assert f"(local engine, step 2) to {out}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["step"] == 2 and config["model"]["seq_len"] == 32 and config["dtypes"] == ["float32"]
    assert json.loads((out / "tokenizer" / "nam.json").read_text())["name"] == "byte"

    model = load(out)
    saved, _ = checkpoint.model_state(trained / "checkpoints" / "step-00000002")
    loaded = model.state_dict()
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name

    # the same forward as the checkpoint's weights in a model built the way nam train builds it: equal outputs
    reference = build_model(get_recipe("nam56r-tiny").model.replace(seq_len=32))
    reference.load_state_dict(saved)
    reference.eval()
    g = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    tokens = torch.randint(0, 257, (2, 33), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 32)}
    with torch.no_grad():
        assert torch.equal(model(**batch)["loss"], reference(**batch)["loss"])


def test_bfloat16_weights_keep_their_dtypes(tmp_path):
    """A bf16 model (D and dt_bias in fp32, as the local engine keeps them) round-trips each tensor's dtype."""
    from nam56r import export
    from nam56r.model import build_model
    from nam56r.recipes import get_recipe

    cfg = get_recipe("nam56r-tiny").model
    torch.manual_seed(0)
    model = build_model(cfg).to(dtype=torch.bfloat16)
    state = model.state_dict()
    export.write(tmp_path / "bf16", state, cfg, step=0, source={})
    loaded = export.load(tmp_path / "bf16").state_dict()
    assert {v.dtype for v in state.values()} == {v.dtype for v in loaded.values()}
    assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in state.items())


def test_a_changed_weights_file_is_refused(trained, tmp_path):
    from nam56r.export import load
    from nam_core.errors import NamError

    out = tmp_path / "export"
    assert run(["export", str(trained / "checkpoints" / "step-00000002"), "--out", str(out)]) == 0
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(NamError, match="sha256 differs"):
        load(out)


def test_without_safetensors_nothing_is_written(trained, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors raises ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert run(["export", str(trained), "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert "needs the 'safetensors' package" in err and "pip install safetensors" in err
    assert not (tmp_path / "export").exists()


def test_a_torn_megatron_checkpoint_is_refused_with_the_reason(tmp_path, capsys):
    """A megatron-engine checkpoint folder whose manifest lists no dist-checkpointing index (a save cut short, or
    not one at all): refused before anything is written, with what is wrong and where to look. (A good one is
    exported in tests/test_megatron_engine_gloo.py, which trains the megatron engine.)"""
    folder = tmp_path / "step-00000004"
    folder.mkdir()
    from nam_core.engine.megatron.checkpoint import CHECKPOINT_FORMAT

    (folder / "manifest.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": 4, "sha256": {}}))
    assert run(["export", str(folder), "--out", str(tmp_path / "export")]) == 6
    err = capsys.readouterr().err
    assert "is not a complete megatron-engine checkpoint (the manifest lists no .metadata" in err, err
    assert f"ls {tmp_path}" in err
    assert not (tmp_path / "export").exists()


def test_a_torn_local_checkpoint_is_refused_exit_6_naming_where_the_good_ones_are(trained, tmp_path, capsys):
    import shutil

    folder = tmp_path / "step-00000002"
    shutil.copytree(trained / "checkpoints" / "step-00000002", folder)
    data = next(p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "manifest.json")
    data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 0xFF]))
    assert run(["export", str(folder), "--out", str(tmp_path / "export")]) == 6
    err = capsys.readouterr().err
    assert f"checkpoint {folder} failed verification (" in err and f"ls {tmp_path.resolve()}" in err, err
    assert "NAM_DEBUG" not in err and not (tmp_path / "export").exists()


def test_the_tokenizer_is_not_taken_from_a_dataset_changed_since_the_run(trained, tmp_path, capsys):
    """The run recorded its dataset's sha256; data prepared again under that path may carry another tokenizer, so
    the export asks for --tokenizer instead of writing the new one. A tokenizer with more ids than the model's
    vocabulary is refused too."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    manifest_file = run_dir / "checkpoints" / "step-00000002" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())  # the run's record, as the checkpoint keeps it
    manifest["record"]["dataset"]["sha256"]["tokens.bin"] = "0" * 64  # what the run read is not what is there now
    manifest_file.write_text(json.dumps(manifest))
    assert run(["export", str(run_dir), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "changed since the run trained on it" in err and "--tokenizer byte" in err, err
    assert not (tmp_path / "a").exists()
    assert run(["export", str(run_dir), "--out", str(tmp_path / "b"), "--tokenizer", "byte"]) == 0
    manifest["record"]["model"]["vocab_size"] = 200
    manifest_file.write_text(json.dumps(manifest))
    assert run(["export", str(run_dir), "--out", str(tmp_path / "c"), "--tokenizer", "byte"]) != 0
    assert "the tokenizer has 257 ids; the model's vocabulary has 200" in capsys.readouterr().err


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path, capsys):
    assert run(["export", str(tmp_path), "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert "is neither a checkpoint folder (no manifest.json) nor a run folder" in err and f"ls {tmp_path}" in err
    assert run(["export", str(tmp_path / "none"), "--out", str(tmp_path / "export")]) == 2
    assert "none: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()


def test_init_from_refuses_another_models_export_with_the_fields(trained, tmp_path, capsys):
    """`nam train --init-from` an export of another model, or a path that is not there: exit 2 before the run
    folder is written (dry runs refuse it too), naming the differing field."""
    out = tmp_path / "export"
    assert run(["export", str(trained), "--out", str(out)]) == 0
    for dry in ([], ["--dry-run"]):
        code = run(["train", "--run-dir", str(tmp_path / "other"), "--max-steps", "1", "--set", "seq_len=64",
                    "--init-from", str(out), "-q", *dry])
        err = capsys.readouterr().err
        assert code == 2 and "seq_len: 32 there, 64 here" in err, err
        assert not (tmp_path / "other").exists()
    code = run(["train", "--run-dir", str(tmp_path / "other"), "--init-from", str(tmp_path / "nowhere"), "--dry-run"])
    assert code == 2 and "no such export folder or weights file" in capsys.readouterr().err


def test_an_export_with_its_optimizer_continues_the_run(tmp_path_factory, tmp_path, capsys):
    """`nam export --with-optimizer` of step 2 and `nam train --init-from` it: the run goes on at step 3 with the
    checkpoint's AdamW moments, step count and lr schedule, on the same rows, and its steps 3 and 4 are the
    original run's (fp32, 1e-6 relative: the same arithmetic; only the RNG state is this run's own)."""
    corpus = prepare_corpus(tmp_path_factory, (textwrap,), chars=4000)
    sets = ["--data", str(corpus), "--set", "seq_len=32", "--set", "train.micro_batch_size=2", "-q"]
    first = tmp_path / "first"
    assert run(["train", "--run-dir", str(first), "--max-steps", "4", "--set", "train.checkpoint_every=2",
                *sets]) == 0
    out = tmp_path / "export"
    assert run(["export", str(first / "checkpoints" / "step-00000002"), "--out", str(out), "--with-optimizer",
                "--tokenizer", "byte"]) == 0
    assert "continues at step 3" in capsys.readouterr().out
    assert run(["train", "--run-dir", str(tmp_path / "next"), "--max-steps", "4", "--init-from", str(out),
                *sets]) == 0
    from nam_core.engine.metrics import read_metrics

    original, carried = read_metrics(first)[2:], read_metrics(tmp_path / "next")
    assert [m["step"] for m in carried] == [3, 4]
    for m, o in zip(carried, original):
        assert m["lr"] == o["lr"] and abs(m["loss"] - o["loss"]) <= 1e-6 * abs(o["loss"]), (m, o)
        assert abs(m["grad_norm"] - o["grad_norm"]) <= 1e-6 * o["grad_norm"], (m, o)
    assert "weights and optimizer state (AdamW step 2" in (tmp_path / "next" / "run.log").read_text()

    # another optimizer_numerics or dtype than the export's: refused before a step, with both and the way out
    code = run(["train", "--run-dir", str(tmp_path / "bf16"), "--max-steps", "3", "--init-from", str(out),
                "--set", "train.dtype=bfloat16", *sets])
    err = capsys.readouterr().err
    assert code != 0 and "carries optimizer state of train.optimizer_numerics=fp32-master and train.dtype=float32" \
        in err and "without --with-optimizer" in err, err
    assert not (tmp_path / "bf16" / "metrics.jsonl").exists()

    # the optimizer's file changed after the export: refused before a step
    data = bytearray((out / "optimizer.safetensors").read_bytes())
    data[-1] ^= 1
    (out / "optimizer.safetensors").write_bytes(bytes(data))
    code = run(["train", "--run-dir", str(tmp_path / "changed"), "--max-steps", "3", "--init-from", str(out), *sets])
    assert code != 0 and "optimizer.safetensors is missing or its sha256 differs" in capsys.readouterr().err
    assert not (tmp_path / "changed" / "metrics.jsonl").exists()


def test_init_from_and_resume_together_are_refused(tmp_path, capsys):
    code = run(["train", "--run-dir", str(tmp_path / "r"), "--init-from", str(tmp_path), "--resume", "auto"])
    assert code == 2 and "--init-from and --resume" in capsys.readouterr().err
