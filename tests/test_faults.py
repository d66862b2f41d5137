"""A run folder that survives anything (issue 22): kills at random moments, Ctrl-C and SIGTERM, two runs on one
folder, a full disk, a corrupt checkpoint, a torn metrics line, a resume that changes the lr, a checkpoint of
another config, and a folder that is not one.

Bit-exact means every tensor of the final checkpoint (model, optimizer, LR schedule) equals the one of an
uninterrupted run. Runs that are killed or signalled are subprocesses, and so is the uninterrupted run they are
compared with (same environment, one thread); the rest run in-process. nam56r-tiny shrunk with --set (as in
test_train.py), a few steps each.
"""

import errno
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nam56r.testing import prepare_corpus
from nam_cli.main import run
from nam_core.engine import checkpoint, rundir
from nam_core.engine.config import TrainConfig
from nam_core.engine.step import lr_lambda
from nam_core.engine.metrics import read_metrics

SMALL = ["--set", "seq_len=32", "--set", "train.micro_batch_size=2", "--set", "train.total_steps=60", "--quiet"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
WAIT_S = 600  # generous: the 2-core CI machine may be busy; a stuck run fails the test, it never hangs it


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import inspect
    import json as json_mod
    import textwrap

    return prepare_corpus(tmp_path_factory, (json_mod, textwrap, inspect), chars=20000)


def args(run_dir: Path, corpus: Path, *extra: str) -> list[str]:
    return ["train", "--run-dir", str(run_dir), "--data", str(corpus), *SMALL, *extra]


def start(argv: list[str], **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nam_cli", *argv], env={**ENV, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=WAIT_S)
    return proc.returncode, err


def logged_steps(run_dir: Path) -> int:
    """Whole lines in metrics.jsonl (a torn last line does not count)."""
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def _wait(proc: subprocess.Popen, reached, what: str) -> bool:
    """Until ``reached()`` (True) or the process ended (False); a run still going after WAIT_S fails the test."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if reached():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {what} in {WAIT_S} s")


def wait_for_steps(proc: subprocess.Popen, run_dir: Path, n: int) -> bool:
    """Until ``n`` steps are logged (True) or the process ended (False)."""
    return _wait(proc, lambda: logged_steps(run_dir) >= n, f"step {n}")


def wait_for_resume(proc: subprocess.Popen, run_dir: Path, before: int) -> bool:
    """Until this process has resumed (run.log's ``resumed from`` lines pass ``before``): before that,
    metrics.jsonl still holds the lines its resume is about to cut."""
    return _wait(proc, lambda: resumes(run_dir) > before, "resume")


def resumes(run_dir: Path) -> int:
    path = run_dir / "run.log"
    return path.read_text().count("resumed from") if path.exists() else 0


def train_config(run_dir: Path, **changes) -> TrainConfig:
    return TrainConfig(**{**json.loads((run_dir / "config.json").read_text())["train"], **changes})


def state(run_dir: Path, step: int) -> dict:
    """A good checkpoint's model, optimizer and scheduler state: format 3's flattened names (the local engine's
    background saves), or the files of formats 1 and 2."""
    folder = run_dir / "checkpoints" / f"step-{step:08d}"
    manifest = checkpoint.verify(folder)
    assert manifest is not None, f"{folder} is not a good checkpoint"
    if manifest["format"] >= 3:
        from nam_core.engine.async_checkpoint import read_flat

        return {k: v for k, v in read_flat(folder).items() if not k.startswith("rng.")}
    return {name: torch.load(folder / name, weights_only=True) for name in ("model.pt", "optimizer.pt", "scheduler.pt")}


DATA_FILE = "state/__0_0.distcp"
"""The tensors' file of a format-3 checkpoint (the local engine's default)."""


def assert_same(a, b, where: str = "") -> None:
    """Equal bit for bit: tensors with torch.equal, everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """An uninterrupted 8-step run (subprocess), a checkpoint every 2 steps."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    code, err = finish(start(args(run_dir, corpus, "--max-steps", "8", "--set", "train.checkpoint_every=2")))
    assert code == 0, err
    return run_dir


@pytest.fixture(scope="module")
def base(tmp_path_factory, corpus):
    """A finished 4-step run (in-process) with checkpoints at 2 and 4; tests copy it (``copy_base``)."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    assert run(args(run_dir, corpus, "--max-steps", "4", "--set", "train.checkpoint_every=2")) == 0
    return run_dir


def copy_base(base: Path, tmp_path: Path) -> Path:
    shutil.copytree(base, tmp_path / "run")
    return tmp_path / "run"


# --- kills, stops, two owners ---------------------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_at_seeded_moments_then_restart_or_resume_is_bit_exact(tmp_path, corpus, reference):
    """Four kills: before the first checkpoint, at two seeded random moments, and mid-save (the save hook);
    then a plain restart (no checkpoint yet) or --resume auto. The end equals the uninterrupted run."""
    rng = random.Random(22)
    run_dir = tmp_path / "killed"
    argv = args(run_dir, corpus, "--max-steps", "8", "--set", "train.checkpoint_every=2")

    proc = start(argv)  # 1: step 1 logged, the first checkpoint (step 2) not yet written
    assert wait_for_steps(proc, run_dir, 1)
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    assert checkpoint.good_checkpoints(run_dir / "checkpoints") == []

    proc = start(argv)  # 2: no --resume: the folder holds no checkpoint and no owner, so it starts afresh
    if wait_for_steps(proc, run_dir, rng.randint(3, 4)):  # at most step 5 done: checkpoint 6 is for kill 3
        time.sleep(rng.uniform(0.0, 0.4))  # anywhere in a step, its metrics line or its save
        proc.send_signal(signal.SIGKILL)
    finish(proc)
    log = (run_dir / "run.log").read_text()
    assert "holds no checkpoint" in log and "starting afresh" in log
    assert "took over" in log  # the killed run's lock file, named and taken over

    code, err = finish(start([*argv, "--resume", "auto"], NAM_TEST_KILL_DURING_SAVE="6"))  # 3: mid-save
    assert code == -signal.SIGKILL, err
    assert any(p.name.startswith(".step-00000006.tmp-") for p in (run_dir / "checkpoints").iterdir())

    before = resumes(run_dir)
    proc = start([*argv, "--resume", "auto"])  # 4: a random moment after the mid-save kill's resume
    if wait_for_resume(proc, run_dir, before) and wait_for_steps(proc, run_dir, rng.randint(6, 7)):
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
    finish(proc)

    code, err = finish(start([*argv, "--resume", "auto"]))
    assert code == 0, err
    assert_same(state(run_dir, 8), state(reference, 8))
    assert [m["loss"] for m in read_metrics(run_dir)] == [m["loss"] for m in read_metrics(reference)]
    assert not any(p.name.startswith(".") for p in (run_dir / "checkpoints").iterdir())
    assert not (run_dir / rundir.LOCK).exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_sigint_and_sigterm_save_the_step_and_the_printed_command_resumes_bit_exact(
        tmp_path, corpus, reference, signum, code):
    """checkpoint_every=100 would save only at the end: the checkpoint on disk is the stop's. A second signal
    while it stops changes nothing."""
    run_dir = tmp_path / "stopped"
    proc = start(args(run_dir, corpus, "--max-steps", "8", "--set", "train.checkpoint_every=100"))
    assert wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signum)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM if signum == signal.SIGINT else signal.SIGINT)
    got, err = finish(proc)
    assert got == code, err
    step = read_metrics(run_dir)[-1]["step"]
    assert 2 <= step < 8
    assert f"stopped by {signal.Signals(signum).name} after step {step} of 8" in err
    assert f"checkpoint {run_dir / 'checkpoints' / f'step-{step:08d}'}" in err
    assert [p.name for p in checkpoint.good_checkpoints(run_dir / "checkpoints")] == [f"step-{step:08d}"]
    assert not (run_dir / rundir.LOCK).exists()

    command = err.split("continue with: ", 1)[1].splitlines()[0]
    argv = shlex.split(command)
    assert argv[:2] == ["nam", "train"] and argv[-2:] == ["--resume", "auto"]
    resumed, err = finish(start(argv[1:]))
    assert resumed == 0, err
    assert_same(state(run_dir, 8), state(reference, 8))


@pytest.mark.slow
def test_two_starts_on_one_folder_at_once_exactly_one_runs(tmp_path, corpus):
    run_dir = tmp_path / "run"
    argv = args(run_dir, corpus, "--max-steps", "3", "--set", "train.checkpoint_every=100")
    procs = [start(argv), start(argv)]
    results = [finish(p) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes[0] == 0 and codes[1] in (2, 6), results  # 6: it met the lock; 2: it came after, found the run
    loser = [err for code, err in results if code != 0][0]
    assert "in use by another run: pid" in loser or "already holds a run" in loser
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert len((run_dir / rundir.HISTORY).read_text().splitlines()) == 1


def test_a_held_folder_is_refused_naming_its_owner_and_nothing_is_written(tmp_path, corpus, capsys):
    run_dir = tmp_path / "run"
    with rundir.RunFolder(run_dir):
        assert run(args(run_dir, corpus, "--max-steps", "2", "--resume", "auto")) == 6
        assert sorted(p.name for p in run_dir.iterdir()) == [rundir.LOCK]
    err = capsys.readouterr().err
    assert f"run folder {run_dir} is in use by another run: pid {os.getpid()}" in err
    assert f"kill -INT {os.getpid()}" in err
    assert not run_dir.exists()  # the holder created it and took it back


def test_a_holder_that_has_not_written_its_pid_yet_is_waited_for_and_then_named(tmp_path):
    """The window between another start's flock and its pid reaching the file (what two starts at once can
    meet): the refusal waits for the pid and names it; a holder that never writes one is described as starting."""
    import fcntl
    import threading
    from nam_core.errors import RunFolderError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = os.open(run_dir / rundir.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, the file still empty
    owner = json.dumps({"pid": 424242, "host": "elsewhere", "started": "now"}).encode()
    writer = threading.Timer(0.3, os.pwrite, (fd, owner, 0))
    writer.start()
    with pytest.raises(RunFolderError, match="in use by another run: pid 424242 on elsewhere") as info:
        rundir.RunFolder(run_dir).acquire()
    assert "kill -INT 424242" in info.value.hint
    writer.join()
    os.ftruncate(fd, 0)
    with pytest.raises(RunFolderError, match="a process that has not written its pid yet"):
        rundir.RunFolder(run_dir).acquire()
    os.close(fd)
    assert sorted(p.name for p in run_dir.iterdir()) == [rundir.LOCK]  # the refused starts wrote nothing


def test_a_folder_whose_run_stopped_before_its_first_checkpoint_starts_afresh(tmp_path, corpus, capsys):
    """What a kill, a NaN or a bad value before the first save leaves: config.json and a few metrics lines.
    Without --resume it restarts (its outputs moved aside); --resume auto does the same, with a note."""
    run_dir = tmp_path / "run"
    assert run(args(run_dir, corpus, "--max-steps", "2", "--set", "train.checkpoint_every=0")) == 0
    assert run(args(run_dir, corpus, "--max-steps", "1", "--set", "train.checkpoint_every=0",
                    "--resume", "auto")) == 0
    [aside] = [p for p in run_dir.iterdir() if p.name.startswith("stopped-")]
    assert [m["step"] for m in read_metrics(aside)] == [1, 2]
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
    log = (run_dir / "run.log").read_text()
    assert "--resume auto: run folder" in log and "holds no checkpoint yet, so this run starts afresh" in log
    assert f"config.json, plugins.json, metrics.jsonl, summary.json moved to {aside}/" in log.replace(
        ", tensorboard", "")  # tensorboard/ too where it is installed
    events = [json.loads(line)["event"] for line in (run_dir / rundir.HISTORY).read_text().splitlines()]
    assert events == ["fresh", "restart"]


# --- recovery: a corrupt checkpoint, a torn line, a changed lr, another config ---------------------------

def test_a_corrupt_newest_checkpoint_is_a_warning_naming_it_and_resume_takes_the_previous(
        tmp_path, corpus, base, capsys):
    run_dir = copy_base(base, tmp_path)
    blob = run_dir / "checkpoints" / "step-00000004" / DATA_FILE
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    blob.write_bytes(bytes(raw))
    assert run(args(run_dir, corpus, "--max-steps", "5", "--set", "train.checkpoint_every=2",
                    "--resume", "auto")) == 0
    err = capsys.readouterr().err  # shown under --quiet
    assert (f"warning: skipped checkpoint {run_dir / 'checkpoints' / 'step-00000004'}: sha256 mismatch of "
            f"{DATA_FILE}" in err)
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000002'} at step 2" in (run_dir / "run.log").read_text()
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]


def test_a_resume_hashes_its_checkpoints_in_the_background_before_build_and_decides_the_same(
        tmp_path, corpus, base, capsys, monkeypatch):
    """``--resume`` starts the check of the checkpoints on the ``nam-verify`` thread before ``build`` (here build
    waits for it, so the test does not hang on which thread is faster); the claim, the load and the pruning then
    find every digest made: each file of the folder is read once, on that thread's helpers. A corrupt newest
    checkpoint is still skipped with the same warning, and the run resumes from the one before."""
    import threading

    import nam56r.run

    run_dir = copy_base(base, tmp_path)
    blob = run_dir / "checkpoints" / "step-00000004" / DATA_FILE
    raw = bytearray(blob.read_bytes())
    raw[random.randrange(len(raw))] ^= 0xFF
    blob.write_bytes(bytes(raw))
    files = sorted(p for p in (run_dir / "checkpoints").rglob("*") if p.is_file() and p.name != "manifest.json")
    monkeypatch.setattr(checkpoint, "_DIGESTS", {})  # as in a new process (copies keep their mtimes, inodes recur)
    real_build, real_hash = nam56r.run.build, checkpoint.file_sha256
    verifiers, reads = [], []

    def build_after_the_check(*a, **kw):
        verifiers.extend(t for t in threading.enumerate() if t.name == "nam-verify")
        for thread in verifiers:
            thread.join(WAIT_S)
        return real_build(*a, **kw)

    def hashing(path, **kw):
        reads.append((Path(path), threading.current_thread().name))
        return real_hash(path, **kw)

    monkeypatch.setattr(nam56r.run, "build", build_after_the_check)
    monkeypatch.setattr(checkpoint, "file_sha256", hashing)
    assert run(args(run_dir, corpus, "--max-steps", "5", "--set", "train.checkpoint_every=2",
                    "--resume", "auto")) == 0
    err = capsys.readouterr().err
    assert (f"warning: skipped checkpoint {run_dir / 'checkpoints' / 'step-00000004'}: sha256 mismatch of "
            f"{DATA_FILE}" in err)
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000002'} at step 2" in (run_dir / "run.log").read_text()
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert len(verifiers) == 1 and not verifiers[0].is_alive()
    assert (f"checkpoint check: the sha256 of {run_dir / 'checkpoints'} ran on a background thread during start-up ("
            in (run_dir / "run.log").read_text())
    of_the_folder = [(path, who) for path, who in reads if path in set(files)]  # not the new saves' (hidden) files
    assert sorted(path for path, _ in of_the_folder) == files, of_the_folder
    assert all(who.startswith("nam-verify") for _, who in of_the_folder), of_the_folder


def test_a_start_that_fails_during_the_background_check_stops_it_and_exits_without_the_rest(
        tmp_path, corpus, base, capsys, monkeypatch):
    """A start refused in ``build`` while the checkpoints are being hashed: the hashes under way give up, the
    thread and its helpers are gone when ``nam train`` returns (nothing left to finish at exit), and the error is
    the start's own."""
    import threading

    import nam56r.run
    from nam_core.errors import ConfigError

    run_dir = copy_base(base, tmp_path)
    monkeypatch.setattr(checkpoint, "_DIGESTS", {})
    real_hash = checkpoint.file_sha256
    reads = []

    def until_stopped(path, *, stop=None):  # a checkpoint too big to hash before build fails
        reads.append(threading.current_thread().name)
        assert stop is not None and stop.wait(30)  # never stopped (broken): the test fails, then exits 30 s later
        return real_hash(path, stop=stop)

    def refused(*a, **kw):
        deadline = time.monotonic() + WAIT_S
        while not reads and time.monotonic() < deadline:
            time.sleep(0.001)
        raise ConfigError("refused by the test", hint="none")

    monkeypatch.setattr(checkpoint, "file_sha256", until_stopped)
    monkeypatch.setattr(nam56r.run, "build", refused)
    assert run(args(run_dir, corpus, "--max-steps", "5", "--resume", "auto")) == 2
    assert "refused by the test" in capsys.readouterr().err
    assert reads and all(name.startswith("nam-verify") for name in reads)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("nam-verify")]


def test_a_folder_with_only_damaged_checkpoints_is_refused_with_a_way_out(tmp_path, corpus, base, capsys):
    """Neither resume nor a fresh start may pick a folder whose every checkpoint is damaged silently: both are
    refused, naming the checkpoints (and, for --resume auto, why each failed) and how to start afresh."""
    run_dir = copy_base(base, tmp_path)
    for step in ("step-00000002", "step-00000004"):
        blob = run_dir / "checkpoints" / step / DATA_FILE
        raw = bytearray(blob.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        blob.write_bytes(bytes(raw))
    assert run(args(run_dir, corpus, "--max-steps", "5", "--resume", "auto")) == 6
    err = capsys.readouterr().err
    assert "no good checkpoint under" in err and f"step-00000004: sha256 mismatch of {DATA_FILE}" in err, err
    assert f"rm -r {run_dir / 'checkpoints'}" in err, err
    assert run(args(run_dir, corpus, "--max-steps", "5")) == 2
    err = capsys.readouterr().err
    assert "holds only damaged checkpoints: step-00000002, step-00000004" in err and "rm -r" in err, err


def test_a_torn_last_metrics_line_is_cut_with_a_note(tmp_path, corpus, base):
    run_dir = copy_base(base, tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lm_loss": 4.2')  # a kill mid-write
    assert run(args(run_dir, corpus, "--max-steps", "5", "--set", "train.checkpoint_every=2",
                    "--resume", "auto")) == 0
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert "metrics.jsonl: cut its last line, not a whole JSON record" in (run_dir / "run.log").read_text()


def test_resume_path_of_another_folder_with_a_new_lr_applies_it_and_records_it(tmp_path, corpus, base):
    """The issue's case: the checkpoint's schedule must not silently replace --set train.lr."""
    run_dir = tmp_path / "b"
    assert run(args(run_dir, corpus, "--max-steps", "5", "--set", "train.checkpoint_every=2",
                    "--set", "train.lr=1e-4", "--resume", str(base / "checkpoints" / "step-00000004"))) == 0
    old_lr = train_config(base).lr
    assert old_lr != 1e-4
    assert read_metrics(run_dir)[-1]["lr"] == 1e-4 * lr_lambda(train_config(run_dir))(4)  # step 5: index 4
    [entry] = [json.loads(line) for line in (run_dir / rundir.HISTORY).read_text().splitlines()]
    assert entry["event"] == "resume" and entry["step"] == 4
    assert entry["changes"] == {"train.lr": [old_lr, 1e-4]}
    assert json.loads((run_dir / "config.json").read_text())["train"]["lr"] == 1e-4
    assert json.loads((run_dir / "checkpoints" / "step-00000005" / "manifest.json").read_text()
                      )["record"]["train"]["lr"] == 1e-4


def test_resume_path_of_another_config_is_refused_with_the_diff(tmp_path, corpus, base, capsys):
    run_dir = tmp_path / "b"
    ckpt = base / "checkpoints" / "step-00000004"
    assert run(args(run_dir, corpus, "--max-steps", "6", "--set", "hidden=32", "--resume", str(ckpt))) == 2
    err = capsys.readouterr().err
    assert f"--resume {ckpt}: checkpoint {ckpt} was made with a different config: model.hidden: 64 -> 32" in err
    assert "a resume may change train.lr" in err
    assert not run_dir.exists()


def test_a_resume_on_other_data_under_the_same_path_is_refused_with_the_files_that_differ(
        tmp_path, corpus, base, capsys):
    """The run records its dataset's checksums; here the run was trained on a tokens.bin whose sha256 was
    another (what `nam data prepare other --out ds --overwrite` under a run leaves)."""
    from nam_core.data.dataset import identity

    run_dir = copy_base(base, tmp_path)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["dataset"] == json.loads(json.dumps(identity(corpus)))
    trained_on = "0" * 64
    for path in [run_dir / "config.json", *(run_dir / "checkpoints").glob("step-*/manifest.json")]:
        body = json.loads(path.read_text())
        record = body if path.name == "config.json" else body["record"]
        record["dataset"]["sha256"]["tokens.bin"] = trained_on
        path.write_text(json.dumps(body))
    history = (run_dir / rundir.HISTORY).read_text()
    assert run(args(run_dir, corpus, "--max-steps", "6", "--set", "train.checkpoint_every=2",
                    "--resume", "auto")) == 2
    err = capsys.readouterr().err
    assert (f"--resume: the data at {corpus.resolve()} is not the data run folder {run_dir} was trained on "
            f"(sha256.tokens.bin: 000000000000... -> {identity(corpus)['sha256']['tokens.bin'][:12]}...)") in err
    assert "resume on the data it was trained on" in err
    assert (run_dir / rundir.HISTORY).read_text() == history  # nothing written


def test_a_resume_on_the_same_files_split_otherwise_is_refused(tmp_path, corpus, base, capsys):
    """`nam data prepare --val-fraction` changes which documents train, not the files' bytes: a run recorded
    its split, and a resume on the same data held out otherwise (held-out documents it trained on, or trained
    documents now held out) is refused; a record from before the split was recorded resumes as before."""
    from nam_core.data.dataset import identity

    run_dir = copy_base(base, tmp_path)
    held = identity(corpus)["validation_documents"]
    for path in [run_dir / "config.json", *(run_dir / "checkpoints").glob("step-*/manifest.json")]:
        body = json.loads(path.read_text())
        record = body if path.name == "config.json" else body["record"]
        record["dataset"]["validation_documents"] = held + 7  # trained on another split of the same files
        path.write_text(json.dumps(body))
    assert run(args(run_dir, corpus, "--max-steps", "5", "--resume", "auto")) == 2
    err = capsys.readouterr().err
    assert f"(validation_documents: {held + 7} -> {held})" in err, err

    from nam_core.engine.rundir import split_changes

    old = {"dataset": {k: v for k, v in identity(corpus).items() if k != "validation_documents"}}
    assert split_changes(old, {"dataset": identity(corpus)}) == ({}, [])  # recorded before 2026-12-08


def test_a_resume_on_another_number_of_processes_is_refused_before_anything_is_written(base):
    """The record holds the run's processes (world_size): a megatron run of 2 resumed on 1 is refused by the
    claim with the difference (exit 2, nothing written), where the checkpoint's layout check stopped it after the
    run folder had a resume line (exit 1); a record from before it was kept resumes as before."""
    from nam_core.engine.rundir import split_changes

    config = json.loads((base / "config.json").read_text())
    assert config["world_size"] == 1  # the local engine: one process
    assert split_changes({**config, "world_size": 2}, config) == ({}, [("world_size", 2, 1)])
    assert split_changes({k: v for k, v in config.items() if k != "world_size"}, config) == ({}, [])


def test_resume_auto_follows_the_branch_of_the_last_start_and_says_so(tmp_path, corpus, base, capsys):
    """Base: steps 1-4, checkpoints 2 and 4. A resume from step 2 is a new branch (its step 3 is not base's);
    --resume auto afterwards takes that branch's step-3, not base's newer step-4."""
    run_dir = copy_base(base, tmp_path)
    common = ("--set", "train.checkpoint_every=2", "--set", "train.keep_checkpoints=3")
    assert run(args(run_dir, corpus, "--max-steps", "3", *common,
                    "--resume", str(run_dir / "checkpoints" / "step-00000002"))) == 0
    capsys.readouterr()
    history = [json.loads(line) for line in (run_dir / rundir.HISTORY).read_text().splitlines()]
    first, fork = history[0]["branch"], history[-1]["branch"]
    assert first and fork and fork != first and history[-1]["from"].endswith("step-00000002")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step-00000002", "step-00000003", "step-00000004"]
    assert run(args(run_dir, corpus, "--max-steps", "5", *common, "--resume", "auto")) == 0
    log = (run_dir / "run.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000003'} at step 3" in log
    assert (f"--resume auto: step-00000003, the newest checkpoint of this run's current branch (branch {fork}"
            in log and "newer step-00000004 belong to another branch" in log)
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert json.loads((run_dir / "checkpoints" / "step-00000005" / "manifest.json").read_text()
                      )["record"]["branch"] == fork


def test_a_resume_with_no_step_left_is_refused_not_negative(tmp_path, corpus, base, capsys):
    run_dir = copy_base(base, tmp_path)
    history = (run_dir / rundir.HISTORY).read_text()
    assert run(args(run_dir, corpus, "--max-steps", "3", "--resume", "auto")) == 2
    err = capsys.readouterr().err
    assert "is at step 4 and this run stops at step 3" in err and "nothing to train" in err
    assert "--resume auto" in err and "--max-steps 3 " not in err  # the hint names a later step
    assert (run_dir / rundir.HISTORY).read_text() == history and not (run_dir / rundir.LOCK).exists()
    assert json.loads((run_dir / "summary.json").read_text())["steps_run"] >= 0


@pytest.mark.parametrize("case, code, message", [
    ("missing", 2, "--resume {ckpt}: no such folder"),
    ("truncated", 6, "--resume {ckpt}: not a complete checkpoint (sha256 mismatch of " + DATA_FILE),
])
def test_resume_of_a_missing_or_truncated_checkpoint_has_its_exit_code(tmp_path, corpus, base, capsys, case, code,
                                                                        message):
    run_dir = copy_base(base, tmp_path)
    ckpt = run_dir / "checkpoints" / "step-00000004"
    if case == "missing":
        ckpt = tmp_path / "nonexistent"
    else:
        data = ckpt / DATA_FILE
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    assert run(args(run_dir, corpus, "--max-steps", "6", "--resume", str(ckpt))) == code
    err = capsys.readouterr().err
    assert message.format(ckpt=ckpt) in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["dangling", "looping"])
def test_a_broken_symlink_as_run_dir_is_exit_6_naming_it(tmp_path, corpus, capsys, kind):
    run_dir = tmp_path / "run"
    if kind == "dangling":
        run_dir.symlink_to(tmp_path / "gone")
    else:
        (tmp_path / "other").symlink_to(run_dir)
        run_dir.symlink_to(tmp_path / "other")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert run(args(run_dir, corpus, "--max-steps", "2")) == 6
    err = capsys.readouterr().err
    what = "does not exist" if kind == "dangling" else "loops"
    assert f"{run_dir} is a symbolic link to " in err and what in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_nan_guard_hint_is_a_command_that_is_accepted(tmp_path, corpus, base, capsys):
    """Resume the base run with an lr that blows up: the hint (a lower lr from the last good checkpoint)
    runs as written: not refused as another config, recorded in history.jsonl."""
    run_dir = copy_base(base, tmp_path)
    blowup = ["--set", "train.lr=1e30", "--set", "train.grad_clip=0"]
    assert run(args(run_dir, corpus, "--max-steps", "6", *blowup, "--resume", "auto")) == 5
    err = capsys.readouterr().err
    command = err.split("with a lower lr: ", 1)[1].splitlines()[0]
    argv = shlex.split(command)
    assert argv[:2] == ["nam", "train"] and "train.lr=1e+29" in argv and argv[-2:] == ["--resume", "auto"]
    assert run(argv[1:]) in (0, 5)  # 1e29 may blow up again: the point is that it is not refused (2)
    history = [json.loads(line) for line in (run_dir / rundir.HISTORY).read_text().splitlines()]
    assert history[-1]["event"] == "resume" and history[-1]["from"].endswith("step-00000004")
    assert history[-1]["changes"]["train.lr"] == [train_config(base).lr, 1e29]


# --- the filesystem --------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["background", "training-thread"])
def test_no_space_during_a_save_is_a_readable_error_and_the_folder_resumes(tmp_path, corpus, monkeypatch, capsys,
                                                                           where):
    """Checkpoint 4 meets a full disk. In the background write (format 3, the test hook raises the kernel's
    ENOSPC in DCP's writer) the error surfaces when the next save waits for it, at step 6; on the training thread
    (``train.async_checkpoints=false``) the kernel's own ENOSPC (/dev/full) under optimizer.pt stops step 4."""
    sets = []
    if where == "background":
        monkeypatch.setenv("NAM_TEST_DISK_FULL_DURING_SAVE", "4")
    else:
        real_open = open

        def full_disk(path, mode="r", *a, **kw):
            if ".step-00000004.tmp-" in str(path) and Path(path).name == "optimizer.pt":
                return real_open("/dev/full", mode, *a, **kw)
            return real_open(path, mode, *a, **kw)

        monkeypatch.setattr(checkpoint, "open", full_disk, raising=False)
        sets = ["--set", "train.async_checkpoints=false"]
    run_dir = tmp_path / "run"
    argv = args(run_dir, corpus, "--max-steps", "6", "--set", "train.checkpoint_every=2", *sets)
    assert run(argv) == 6
    err = capsys.readouterr().err
    assert f"no space left on {run_dir / 'checkpoints'} (disk " in err and "a checkpoint needs about " in err
    assert "the newest good checkpoint, step-00000002, is intact" in err
    assert "--resume auto" in err and "Traceback" not in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002"]
    assert not (run_dir / rundir.LOCK).exists()

    monkeypatch.undo()
    assert run([*argv, "--resume", "auto"]) == 0
    assert "at step 2" in (run_dir / "run.log").read_text()
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]


def test_a_real_full_disk_is_exit_6_and_resume_auto_goes_on_from_the_last_good_checkpoint(
        tmp_path, corpus, base, small_disk, capsys):
    """A tmpfs with room for two checkpoints and a half: the third save meets the kernel's short write (in the
    background writer; the run's end waits for it and stops with the error)."""
    size_mb = sum(p.stat().st_size for p in (base / "checkpoints" / "step-00000004").rglob("*") if p.is_file()) / 2**20
    disk = small_disk(2.5 * size_mb + 0.5)
    run_dir = disk / "run"
    argv = args(run_dir, corpus, "--max-steps", "6", "--set", "train.checkpoint_every=2")
    expected = f"no space left on {run_dir / 'checkpoints'} (disk {disk}: a checkpoint needs about "
    for attempt in ("first run", "--resume auto"):
        assert run(argv if attempt == "first run" else [*argv, "--resume", "auto"]) == 6, attempt
        err = capsys.readouterr().err
        assert expected in err and "the newest good checkpoint, step-00000004, is intact" in err, (attempt, err)
        # the estimate is the state's tensor bytes; the files add DCP's index and per-value records (format 3)
        estimate = float(err.split(expected)[1].split(" MB")[0])
        assert abs(estimate - size_mb) <= 0.1 * size_mb, (estimate, size_mb)
        assert "Traceback" not in err and "--resume auto" in err
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
        assert not (run_dir / rundir.LOCK).exists()
    assert "resumed from" in (run_dir / "run.log").read_text() and "at step 4" in (run_dir / "run.log").read_text()
    shutil.rmtree(run_dir / "checkpoints" / "step-00000002")  # the user frees space
    assert run([*argv, "--resume", "auto"]) == 0
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("case", ["file-as-run-dir", "file-as-checkpoints", "file-as-parent", "read-only",
                                  "permission"])
def test_an_unusable_run_folder_is_one_block_error_before_anything_is_written(tmp_path, corpus, monkeypatch,
                                                                               capsys, case):
    run_dir = tmp_path / "run"
    if case == "file-as-run-dir":
        run_dir.write_text("not a folder")
        message = f"{run_dir} is a file; the run needs a folder there"
    elif case == "file-as-checkpoints":
        run_dir.mkdir()
        (run_dir / "checkpoints").write_text("not a folder")
        message = f"{run_dir / 'checkpoints'} is a file; the run needs a folder there"
    elif case == "file-as-parent":
        (tmp_path / "parent").write_text("not a folder")
        run_dir = tmp_path / "parent" / "run"
        message = f"cannot create the run folder {run_dir}: {tmp_path / 'parent'} is a file"
    else:  # as root (CI), chmod and a read-only mount are out of reach: what the kernel would answer
        real_statvfs, real_access = os.statvfs, os.access
        if case == "read-only":
            monkeypatch.setattr(rundir.os, "statvfs", lambda p: type("V", (), {"f_flag": os.ST_RDONLY})()
                                if Path(p) == tmp_path else real_statvfs(p))
            message = f"cannot write to {tmp_path}: read-only filesystem"
        else:
            monkeypatch.setattr(rundir.os, "access", lambda p, m: False if Path(p) == tmp_path else real_access(p, m))
            message = f"cannot write to {tmp_path}: permission denied"
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert run(args(run_dir, corpus, "--max-steps", "2")) == 6
    err = capsys.readouterr().err
    assert message in err and "hint:" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_filesystem_errors_during_the_run_become_readable():
    cases = {errno.ENOSPC: "cannot write to /runs/x/metrics.jsonl: no space left on the device",
             errno.EROFS: "cannot write to /runs/x/metrics.jsonl: read-only filesystem",
             errno.EACCES: "cannot use /runs/x/metrics.jsonl: permission denied",
             errno.ENOTDIR: "cannot use /runs/x/metrics.jsonl: a file stands where a folder should be"}
    for code, message in cases.items():
        error = rundir.filesystem_error(OSError(code, os.strerror(code), "/runs/x/metrics.jsonl"), Path("/runs/x"))
        assert (error.exit_code, error.message) == (6, message)
        assert "--run-dir" in error.hint
    assert rundir.filesystem_error(OSError(errno.EIO, "I/O error"), Path("/runs/x")) is None  # stays a traceback


def test_a_save_that_waits_for_the_previous_write_says_how_long(base):
    """The second background save of the base run (step 4) first waits for step 2's write: run.log says so with
    the seconds, as part of what that checkpoint cost training (bench/checkpoint.py adds it to the stall)."""
    log = (base / "run.log").read_text()
    waited = [line for line in log.splitlines() if "training waited" in line]
    assert len(waited) == 1 and "/checkpoints/step-00000004: training waited " in waited[0], log
    assert "step-00000002: training paused" in log and "step-00000004: training paused" in log


def test_the_host_buffers_are_built_after_the_first_step_and_the_first_save_says_what_it_waited(base):
    """The base run's host buffers start being built after its first step; the first save (step 2) says how long
    it waited for them, as part of its pause; the step-4 save reuses them and says nothing of them."""
    log = (base / "run.log").read_text().splitlines()
    building = [i for i, line in enumerate(log) if "checkpoint host buffers: building" in line]
    took = [line for line in log if "its host buffers (" in line]
    assert len(building) == 1 and "(pageable) on a background thread" in log[building[0]], log
    assert len(took) == 1 and "/checkpoints/step-00000002: its host buffers (" in took[0], log
    assert "the save waited " in took[0] and "s for them (part of its pause)" in took[0]
    paused = [line for line in log if "training paused" in line]
    assert "s of it waiting for the host buffers" in paused[0] and "waiting for the host" not in paused[1], paused
