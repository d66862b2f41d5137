"""``nam train`` end to end on CPU: resume bit-exactness, crash safety of checkpoints, and bad inputs.

The runs use nam56r-tiny shrunk further with --set (short rows, small batch) so the file stays fast on
2 cores; the 80-step loss-falls run of the issue is in test_train_slow.py.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nam56r.testing import prepare_corpus
from nam_cli.main import run
from nam_core.engine.metrics import read_metrics

FAST = ["--set", "seq_len=32", "--set", "train.micro_batch_size=2", "--set", "train.checkpoint_every=10",
        "--set", "train.total_steps=60", "--quiet"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small prepared dataset of Python files (faster than the stdlib default)."""
    import inspect
    import json as json_mod
    import textwrap

    return prepare_corpus(tmp_path_factory, (json_mod, textwrap, inspect), chars=20000)


def losses(run_dir: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir)]


def train(run_dir, corpus, *extra) -> int:
    return run(["train", "--run-dir", str(run_dir), "--data", str(corpus), *FAST, *extra])


def test_resumed_run_equals_uninterrupted_run_step_for_step(tmp_path, corpus):
    full, split = tmp_path / "full", tmp_path / "split"
    assert train(full, corpus, "--max-steps", "60") == 0
    assert train(split, corpus, "--max-steps", "30") == 0
    assert train(split, corpus, "--max-steps", "60", "--resume", "auto") == 0
    a, b = losses(full), losses(split)
    assert len(a) == len(b) == 60
    assert a == b  # bit for bit: same data order, RNG, optimizer and LR schedule
    summary = json.loads((split / "summary.json").read_text())
    assert summary["started_at_step"] == 30
    lrs = [m["lr"] for m in read_metrics(full)]
    assert lrs == [m["lr"] for m in read_metrics(split)]


@pytest.mark.slow
def test_bf16_fp32_master_resume_is_bit_exact_and_a_change_of_numerics_is_refused(tmp_path, corpus, capsys):
    """The default numerics of a bf16 run (fp32 master weights, nam_core/engine/numerics.py): the checkpoint
    carries the masters, so a resumed run equals an uninterrupted one bit for bit; resuming it under other
    numerics is refused (exit 2) with the field's old and new value."""
    bf16 = ["--set", "train.dtype=bfloat16", "--set", "train.checkpoint_every=2"]
    full, split = tmp_path / "full", tmp_path / "split"
    assert train(full, corpus, *bf16, "--max-steps", "4") == 0
    assert train(split, corpus, *bf16, "--max-steps", "2") == 0
    assert train(split, corpus, *bf16, "--set", "train.optimizer_numerics=bf16", "--max-steps", "4",
                 "--resume", "auto") == 2
    assert "train.optimizer_numerics: 'fp32-master' -> 'bf16'" in capsys.readouterr().err
    assert train(split, corpus, *bf16, "--max-steps", "4", "--resume", "auto") == 0
    assert losses(full) == losses(split) and len(losses(full)) == 4
    summary = json.loads((split / "summary.json").read_text())
    assert summary["numerics"].startswith("fp32-master: fp32 master weights")
    manifest = json.loads((split / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    assert manifest["record"]["train"]["optimizer_numerics"] == "fp32-master"


def test_kill_during_save_keeps_the_last_good_checkpoint_and_resume_matches(tmp_path, corpus):
    """SIGKILL the process while it writes checkpoint 20; resume auto must take 10 and end equal."""
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    env = dict(os.environ, NAM_TEST_KILL_DURING_SAVE="20")
    cmd = [sys.executable, "-m", "nam_cli", "train", "--run-dir", str(killed), "--data", str(corpus),
           *FAST, "--max-steps", "30"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ckpts = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert "step-00000010" in ckpts and "step-00000020" not in ckpts
    assert any(name.startswith(".step-00000020.tmp-") for name in ckpts)  # the half-written save

    assert train(killed, corpus, "--max-steps", "30", "--resume", "auto") == 0
    assert train(clean, corpus, "--max-steps", "30") == 0
    assert losses(killed) == losses(clean)
    assert not any(p.name.startswith(".") for p in (killed / "checkpoints").iterdir())


def test_non_finite_loss_stops_with_step_layer_and_checkpoint(tmp_path, corpus, capsys):
    code = train(tmp_path / "nan", corpus, "--max-steps", "15", "--set", "train.lr=1e30",
                 "--set", "train.warmup_steps=1", "--set", "train.grad_clip=0")
    assert code == 5
    err = capsys.readouterr().err
    assert "non-finite" in err and "at step" in err and "last good checkpoint" in err
    assert "parameter " in err or "gradient of " in err or "loss itself" in err


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--recipe", "nam999"], 2, "unknown recipe 'nam999'"),
        (["--set", "hiden=128"], 2, "the model config has no field 'hiden' (did you mean hidden?)"),
        (["--set", "hidden=wide"], 2, "--set hidden=wide: expected int"),
        (["--set", "train.lrr=1"], 2, "TrainConfig has no field 'lrr'"),
        (["--plugins", "no-such-plugin"], 3, "no-such-plugin: installed"),
        (["--device", "cuda"], 3, "no CUDA device"),
        (["--engine", "megatron"], 2, "the megatron engine runs on CUDA devices only"),
        (["--engine", "megatron", "--device", "cuda", "--nproc", "2", "--ep", "4"], 2,
         "ep=4 must divide the data-parallel size 2"),
        (["--engine", "megatron", "--device", "cuda", "--tp", "2", "--nproc", "2"], 2,
         "cannot close these gaps of the lowering: tensor parallelism"),
        (["--engine", "deepspeed"], 2, "expected local or megatron"),
        (["--tp", "2"], 2, "a parallel layout (--tp, --pp, --ep, train.tp/pp/ep) are megatron-engine options"),
        (["--set", "train.ep=2"], 2, "the local engine runs one process on one device (found nproc=None"),
        (["--set", "train.checkpoint_every=-1"], 2, "train.checkpoint_every=-1: expected an integer >= 0 (0: no checkpoints)"),
    ],
)
def test_bad_input_fails_cleanly_and_writes_nothing(tmp_path, corpus, capsys, args, code, message):
    run_dir = tmp_path / "run"
    assert run(["train", "--run-dir", str(run_dir), "--data", str(corpus), "--quiet", *args]) == code
    assert message in capsys.readouterr().err
    assert not run_dir.exists()


def test_checkpoint_every_zero_trains_and_writes_no_checkpoint(tmp_path, corpus):
    """A benchmark's run: metrics for every step, no checkpoint, not even at the end."""
    assert train(tmp_path / "run", corpus, "--max-steps", "3", "--set", "train.checkpoint_every=0") == 0
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_megatron_engine_on_this_cpu_machine_lists_what_is_missing(tmp_path, corpus, capsys, monkeypatch):
    """Past the config checks, a run outside torchrun on a machine without CUDA or megatron-core 0.19 stops
    with one error naming each missing piece (exit 3), before writing anything."""
    pytest.importorskip("megatron.core")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    run_dir = tmp_path / "run"
    assert run(["train", "--run-dir", str(run_dir), "--data", str(corpus), "--quiet", "--engine", "megatron",
                "--device", "cuda"]) == 3
    err = capsys.readouterr().err
    for missing in ("CUDA: needs a CUDA device", "torchrun launch: needs WORLD_SIZE set by torchrun"):
        assert missing in err
    assert not run_dir.exists()


def test_nproc_relaunches_the_same_command_under_torchrun():
    from nam_cli.train import _torchrun_argv

    argv = _torchrun_argv(["train", "--engine", "megatron", "--nproc", "4", "--ep", "4", "--nproc=4", "-q"], 4)
    assert argv[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "nam_cli",
                        "train", "--engine", "megatron", "--ep", "4", "-q"]


def test_the_continue_command_of_a_relaunched_run_carries_its_nproc(tmp_path, monkeypatch):
    """`--nproc 4` relaunches the command under torchrun without the flag; the command a stop or the summary
    prints to continue the run must work as written outside torchrun, so it carries `--nproc 4` again."""
    import typer

    from nam_cli.main import app
    from nam_cli.train import RELAUNCHED_NPROC, _again

    train = typer.main.get_command(app).commands["train"]
    as_relaunched = train.make_context("train", ["--engine", "megatron", "--ep", "4"])  # what torchrun's ranks got
    monkeypatch.setenv(RELAUNCHED_NPROC, "4")
    again = _again(tmp_path / "run", as_relaunched)(resume="auto")
    assert again.startswith("nam train --engine megatron --ep 4 --nproc 4 --run-dir ") and again.endswith(" --resume auto")
    monkeypatch.delenv(RELAUNCHED_NPROC)
    assert "--nproc" not in _again(tmp_path / "run", as_relaunched)(resume="auto")  # a torchrun of the user's own


def test_missing_dataset_is_a_data_error(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run(["train", "--run-dir", str(run_dir), "--data", str(tmp_path / "nope"), "--quiet"]) == 4
    assert "nam data prepare" in capsys.readouterr().err
    assert not run_dir.exists()


def test_corrupt_dataset_is_a_data_error(tmp_path, corpus, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(corpus, bad)
    idx = bad / "tokens.idx"
    raw = bytearray(idx.read_bytes())
    raw[-1] ^= 0xFF
    idx.write_bytes(bytes(raw))
    assert run(["train", "--run-dir", str(tmp_path / "run"), "--data", str(bad), "--quiet"]) == 4
    assert "tokens.idx" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_dataset_vocabulary_larger_than_the_model_is_refused(tmp_path, corpus, capsys):
    code = run(["train", "--run-dir", str(tmp_path / "run"), "--data", str(corpus), "--quiet",
                "--set", "vocab_size=100"])
    assert code == 4
    assert "vocab" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_run_folder_of_another_run_is_refused(tmp_path, corpus, capsys):
    run_dir = tmp_path / "run"
    assert train(run_dir, corpus, "--max-steps", "2") == 0
    before = sorted(p.name for p in run_dir.rglob("*"))
    assert train(run_dir, corpus, "--max-steps", "2") == 2  # no --resume: refused
    assert "already holds a run" in capsys.readouterr().err
    assert train(run_dir, corpus, "--max-steps", "4", "--resume", "auto", "--set", "hidden=32") == 2
    assert "belongs to a different config" in capsys.readouterr().err
    assert sorted(p.name for p in run_dir.rglob("*")) == before


def test_dry_run_builds_on_meta_and_writes_nothing(tmp_path, capsys):
    assert run(["train", "--dry-run", "--json", "--run-dir", str(tmp_path / "run")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["layers"]) == 52 and plan["backends"]["ssm"] == "ReferenceSSMScan"
    assert not (tmp_path / "run").exists()


def test_run_folder_contents(tmp_path, corpus):
    run_dir = tmp_path / "run"
    assert train(run_dir, corpus, "--max-steps", "3") == 0
    assert json.loads((run_dir / "config.json").read_text())["recipe"] == "nam56r-tiny"
    assert json.loads((run_dir / "plugins.json").read_text())["active"]["reference"]["distribution"] == "nam-train"
    [m] = read_metrics(run_dir)[-1:]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mem_gib"):
        assert key in m
    assert (run_dir / "checkpoints" / "step-00000003" / "manifest.json").exists()


def test_engine_logs_each_pending_note_once():
    from types import SimpleNamespace

    from nam_core.engine.local import _drain_notes, _State

    logged = []
    run = SimpleNamespace(notes=["a", "b", "a"])
    state = _State(optimizer=None, scheduler=None, log=SimpleNamespace(note=logged.append), start=0)
    _drain_notes(run, state)
    run.notes.extend(["b", "c"])  # what forward appends from ForwardState.log on a later step
    _drain_notes(run, state)
    assert logged == ["a", "b", "c"] and run.notes == []


# --- what a newcomer is told: the continue hint, the step line, where things are (issue 34) ---------------


def test_the_continue_hint_is_a_command_that_trains_on(tmp_path, corpus, capsys):
    """The refused second start names a command that trains more steps; a resume with no step left is exit 2."""
    import shlex

    run_dir = tmp_path / "run"
    assert train(run_dir, corpus, "--max-steps", "2") == 0
    quiet = capsys.readouterr()
    assert quiet.err == "" and quiet.out == ""  # --quiet: nothing before, during or after the steps
    assert train(run_dir, corpus, "--max-steps", "2") == 2
    hint = capsys.readouterr().err.split("hint: ", 1)[1]
    assert hint.startswith("continue it to step 4 (--max-steps is the step to stop at")
    argv = shlex.split(hint.split("): ", 1)[1].split("; or choose another --run-dir", 1)[0])
    assert argv[:2] == ["nam", "train"] and argv[argv.index("--max-steps") + 1] == "4"
    assert run(argv[1:]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["started_at_step"], summary["steps_run"]) == (2, 2)
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]

    assert train(run_dir, corpus, "--max-steps", "4", "--resume", "auto") == 2  # nothing left to train
    err = capsys.readouterr().err
    assert "is at step 4 and this run stops at step 4" in err and "nothing to train" in err
    assert "continue it to step 8" in err and "NAM_DEBUG" not in err
    assert json.loads((run_dir / "summary.json").read_text())["steps_run"] == 2  # the refusal wrote nothing


def test_at_the_end_of_the_schedule_the_hint_lengthens_it(tmp_path, corpus, capsys):
    import shlex

    run_dir = tmp_path / "run"
    short = ["--set", "train.total_steps=2", "--set", "train.warmup_steps=1"]
    assert train(run_dir, corpus, *short) == 0
    assert train(run_dir, corpus, *short, "--resume", "auto") == 2
    hint = capsys.readouterr().err.split("hint: ", 1)[1]
    assert "reached train.total_steps (2)" in hint and "continue it to step 4" in hint
    argv = shlex.split(hint.split("schedule that long: ", 1)[1].strip())
    assert "train.total_steps=4" in argv
    assert run(argv[1:]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps_run"] == 2


def test_step_lines_show_the_lm_loss_and_the_end_says_where_things_are(tmp_path, corpus, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", "--run-dir", str(run_dir), "--data", str(corpus), *FAST[:-1], "--max-steps", "2"]
    assert run(argv) == 0
    captured = capsys.readouterr()
    before = captured.err.split("\nstep 1 ", 1)[0]  # what is said before the first step, in this order
    said = ["nam train: recipe nam56r-tiny (52 layers", "plugins: reference; backends: ssm reference",
            f"data: {corpus}\n", f"run folder: {run_dir} (a new run; steps 1 to 2)", "building the model (float32, on cpu)",
            "parameters; the first step warms up"]
    assert [before.find(line) for line in said] == sorted(before.find(line) for line in said) and -1 not in \
        [before.find(line) for line in said], before
    records = read_metrics(run_dir)
    for record in records:
        assert f"step {record['step']} LM loss {record['lm_loss']:.4f} (" in captured.err
        assert f"mtp_loss {record['mtp_loss']:.4g}" in captured.err
        assert record["lm_loss"] != record["loss"]  # the line shows the summary's loss, not the total
    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    assert summary["checkpoint"] == str(checkpoint) and checkpoint.is_dir()
    assert summary["metrics"] == str(run_dir / "metrics.jsonl")
    assert " --max-steps 4 " in summary["continue_with"] and summary["continue_with"].endswith(" --resume auto")
    assert f"checkpoint: {checkpoint}\n" in captured.out
    assert f"  {summary['continue_with']}\n" in captured.out and "--resume auto" in summary["continue_with"]
    assert f"metrics: {run_dir / 'metrics.jsonl'}" in captured.out
    assert f"checkpoint {checkpoint}: training paused" in (run_dir / "run.log").read_text()


def test_data_without_structure_ids_is_said_in_the_run_log(tmp_path, corpus):
    """Every NAM56R model has a structure embedding; data prepared with --no-structure gives it no input. That
    trains (the ids are optional in the data), but not silently: run.log says so and how to prepare them."""
    import inspect
    import textwrap as module

    from nam_core.data.prepare import prepare
    from nam_core.data.tokenizer import load_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "m.py").write_text(inspect.getsource(module)[:20000])
    bare = tmp_path / "bare"
    prepare(src, bare, load_tokenizer("byte"), annotate=None, progress=False)
    assert train(tmp_path / "run", bare, "--max-steps", "1") == 0
    log = (tmp_path / "run" / "run.log").read_text()
    assert f"warning: data: {bare} carries no structure ids" in log and "nam data prepare SRC --out DIR" in log
    assert train(tmp_path / "with", corpus, "--max-steps", "1") == 0
    assert "structure ids" not in (tmp_path / "with" / "run.log").read_text()
