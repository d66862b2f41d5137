"""Checkpoints: verified by sha256, corrupt or partial ones are never picked, old ones pruned after a save."""

import errno
import hashlib
import json
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from nam_core.data.dataset import file_sha256
from nam_core.engine import checkpoint
from nam_core.errors import NamError, RunFolderError


def _parts():
    return _parts_of(torch.nn.Linear(4, 4))


def _parts_of(model):
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return dict(model=model, optimizer=opt, scheduler=sched)


def test_auto_resume_skips_a_corrupt_newest_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        checkpoint.save(root, step, **_parts(), extra={}, keep=3)
    blob = root / "step-00000020" / "model.pt"
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    blob.write_bytes(bytes(raw))
    assert checkpoint.resolve_resume("auto", root).name == "step-00000010"
    with pytest.raises(NamError, match="sha256 mismatch"):
        checkpoint.resolve_resume(str(root / "step-00000020"), root)


def test_only_the_newest_are_kept_and_load_restores_weights(tmp_path):
    root = tmp_path / "checkpoints"
    parts = _parts()
    for step in (1, 2, 3):
        checkpoint.save(root, step, **parts, extra={"note": step}, keep=2)
    assert [p.name for p in checkpoint.good_checkpoints(root)] == ["step-00000002", "step-00000003"]
    fresh = _parts()
    manifest = checkpoint.load(root / "step-00000003", **fresh)
    assert manifest["step"] == 3 and manifest["note"] == 3
    assert torch.equal(fresh["model"].weight, parts["model"].weight)


def test_a_save_after_a_resume_from_an_earlier_step_is_kept_with_the_later_branch(tmp_path):
    """Saved 2 and 4, resumed from 2 (a new branch), saved 3 with keep 1: 3 stays (it was deleted when the
    pruning counted 4, another branch's, as newer), 2 goes, 4 is not this save's to delete."""
    root = tmp_path / "checkpoints"
    parts = _parts()
    for step in (2, 4):
        checkpoint.save(root, step, **parts, extra={}, keep=2)
    folder = checkpoint.save(root, 3, **parts, extra={}, keep=1)
    assert folder.is_dir() and checkpoint.verify(folder) is not None
    assert [p.name for p in checkpoint.good_checkpoints(root)] == ["step-00000003", "step-00000004"]


def test_pruning_keeps_the_save_and_the_ones_before_it():
    steps = [Path(f"step-{s:08d}") for s in (1, 2, 3, 5, 6)]
    names = lambda paths: [p.name[-1] for p in paths]  # noqa: E731
    assert names(checkpoint.pruned(steps, steps[3], 2)) == ["1", "2"]  # keeps 3 and 5; 6 (later) not counted
    assert names(checkpoint.pruned(steps, steps[4], 2)) == ["1", "2", "3"]
    assert checkpoint.pruned(steps, steps[0], 1) == [] and checkpoint.pruned(steps, steps[4], 9) == []


def test_resume_auto_without_checkpoints_is_an_error(tmp_path):
    with pytest.raises(NamError, match="no good checkpoint"):
        checkpoint.resolve_resume("auto", tmp_path / "none")


def _rewrite_manifest(folder):
    """What an attacker does after replacing a file: the manifest's sha256 then matches again."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["sha256"] = {name: file_sha256(folder / name) for name in manifest["sha256"]}
    (folder / "manifest.json").write_text(json.dumps(manifest))


class _RunsCode:
    """Unpickling this runs ``open(marker, "w")``: a stand-in for ``os.system``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["rng.pt", "model.pt", "optimizer.pt", "scheduler.pt"])
def test_a_crafted_pickle_in_a_checkpoint_is_refused_and_runs_nothing(tmp_path, name):
    root = tmp_path / "checkpoints"
    folder = checkpoint.save(root, 5, **_parts(), extra={}, keep=2)
    marker = tmp_path / "pwned"
    torch.save({"torch": _RunsCode(marker)}, folder / name)
    _rewrite_manifest(folder)
    assert checkpoint.verify(folder) is not None  # the hash cannot tell: only the loader protects
    with pytest.raises(RunFolderError, match=rf"{name}: refused to load.*names io.open") as info:
        checkpoint.load(folder, **_parts())
    assert info.value.exit_code == 6
    assert not marker.exists()
    torch.load(folder / name, weights_only=False)  # the file is a real threat: a full unpickle runs it
    assert marker.exists()


def test_rng_state_round_trips_through_a_tensors_only_load(tmp_path):
    """Format 2: every generator's state resumes exactly, from a file torch loads with weights_only=True."""
    torch.manual_seed(int(np.random.default_rng().integers(1 << 30)))
    random.gauss(0, 1), np.random.randn()  # a cached Gaussian in both (the part a naive copy loses)
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    before = (torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    after = (torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn())
    assert after == before


def test_a_format_1_rng_file_with_numpy_arrays_still_loads(tmp_path):
    """Checkpoints written before format 2 pickled numpy's state as an ndarray: allowed, and nothing more."""
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
               tmp_path / "rng.pt")
    expected = np.random.rand()
    checkpoint.set_rng_state(checkpoint._load_rng(tmp_path / "rng.pt", {"format": 1}))
    assert np.random.rand() == expected
    torch.save({"numpy": _RunsCode(tmp_path / "pwned")}, tmp_path / "rng.pt")
    with pytest.raises(RunFolderError, match="refused to load"):
        checkpoint._load_rng(tmp_path / "rng.pt", {"format": 1})
    assert not (tmp_path / "pwned").exists()


def test_a_real_full_disk_is_exit_6_naming_the_disk_and_the_size_and_leaves_no_partial_save(small_disk):
    """On a 30 MB tmpfs, checkpoints of ~12 MB (a 1024x1024 linear layer with AdamW's two moments): two fit, the
    third meets the kernel's short write mid-file (torch then fails again closing its archive)."""
    disk = small_disk(30)
    root = disk / "checkpoints"
    parts = _parts_of(torch.nn.Linear(1024, 1024))
    parts["model"](torch.randn(2, 1024)).sum().backward()
    parts["optimizer"].step()  # AdamW's moments exist from the first step on
    for step in (1, 2):
        checkpoint.save(root, step, **parts, extra={}, keep=3)
    with pytest.raises(RunFolderError) as info:
        checkpoint.save(root, 3, **parts, extra={}, keep=3)
    message = str(info.value)
    assert info.value.exit_code == 6
    assert f"no space left on {root} (disk {disk}: a checkpoint needs about 12 MB" in message
    assert "the newest good checkpoint, step-00000002, is intact" in message and "--resume auto" in message
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002"]  # no .step-*.tmp left
    fresh = _parts_of(torch.nn.Linear(1024, 1024))
    assert checkpoint.load(root / "step-00000002", **fresh)["step"] == 2
    assert torch.equal(fresh["model"].weight, parts["model"].weight)


# --- the digest cache under threads: one read per file version, errors to every waiter, a stoppable pass -------

WAIT_S = 60  # a guard against a hang (a lost wake-up fails the test), never a timing assertion


def _random_file(path, most=3 << 20):
    path.write_bytes(os.urandom(random.randint(1, most)))  # up to 3 MiB: under one read block and over it
    return path


def _waiters(path) -> int:
    """Threads waiting in ``_sha256`` for another thread's hash of ``path``'s current version."""
    st = path.stat()
    with checkpoint._DIGESTS_LOCK:
        hashing = checkpoint._HASHING.get(checkpoint.file_version(st))
        return hashing.waiters if hashing is not None else 0


def test_a_same_size_rewrite_with_its_mtime_set_back_is_hashed_again(tmp_path):
    """A file rewritten in place (same inode, same size) whose mtime is then set back to the old one (``cp -p``,
    ``rsync -t`` do that) is a new version: its digest is not the cached one."""
    path = _random_file(tmp_path / "a.bin", most=1 << 16)
    before = path.stat()
    first = checkpoint._sha256(path)
    with open(path, "r+b") as f:  # in place: the inode stays
        f.write(bytes(b ^ 0xFF for b in path.read_bytes()))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert checkpoint._sha256(path) == file_sha256(path) != first


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {WAIT_S} s"
        time.sleep(0.001)


def _asking(path, answers: dict, name: str) -> threading.Thread:
    """A thread that asks ``_sha256(path)`` and puts its digest or its exception in ``answers[name]``."""
    def ask():
        try:
            answers[name] = checkpoint._sha256(path)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            answers[name] = exc

    thread = threading.Thread(target=ask, name=name)
    thread.start()
    return thread


def _held_first_read(monkeypatch, fail: BaseException | None = None):
    """Wrap ``checkpoint.file_sha256``: every read is listed; the first waits for ``release`` (so a second caller
    can arrive meanwhile), then raises ``fail`` if given, else hashes. Returns (reads, inside, release)."""
    real = checkpoint.file_sha256
    reads, inside, release = [], threading.Event(), threading.Event()

    def held(path, **kw):
        reads.append(path)
        if len(reads) == 1:
            inside.set()
            assert release.wait(WAIT_S)
            if fail is not None:
                raise fail
        return real(path, **kw)

    monkeypatch.setattr(checkpoint, "file_sha256", held)
    return reads, inside, release


def _two_callers_at_once(blob, monkeypatch, fail=None) -> tuple[dict, list]:
    """Two threads ask ``_sha256(blob)``, the second while the first's read is held (``_held_first_read``): their
    answers (digest or exception) and the reads made."""
    reads, inside, release = _held_first_read(monkeypatch, fail=fail)
    answers = {}
    first = _asking(blob, answers, "first")
    assert inside.wait(WAIT_S)
    second = _asking(blob, answers, "second")
    # the overlap happened: the second caller waits (or, broken, reads it again: then fail at once)
    _until(lambda: _waiters(blob) == 1 or len(reads) > 1, "second caller waiting")
    release.set()
    first.join(WAIT_S), second.join(WAIT_S)
    return answers, reads


def test_two_threads_asking_for_one_file_at_once_read_it_once_and_both_get_its_digest(tmp_path, monkeypatch):
    blob = _random_file(tmp_path / "blob")
    expected = hashlib.sha256(blob.read_bytes()).hexdigest()
    answers, reads = _two_callers_at_once(blob, monkeypatch)
    assert answers == {"first": expected, "second": expected}
    assert reads == [blob]
    assert checkpoint._sha256(blob) == expected and reads == [blob]  # and cached


def test_an_error_of_the_first_caller_reaches_the_waiting_one_and_a_later_call_hashes_again(tmp_path, monkeypatch):
    blob = _random_file(tmp_path / "blob")
    failure = OSError(errno.EIO, os.strerror(errno.EIO), str(blob))
    answers, reads = _two_callers_at_once(blob, monkeypatch, fail=failure)
    assert answers["first"] is failure and answers["second"] is failure  # as it would reach a single caller
    assert reads == [blob]
    assert checkpoint._sha256(blob) == hashlib.sha256(blob.read_bytes()).hexdigest()  # the error was not kept
    assert reads == [blob, blob]


def test_a_stopped_background_check_gives_up_at_once_and_leaves_nothing_cached(tmp_path, monkeypatch):
    """``VerifyAhead.stop``: hashes under way give up at their next block, files not begun are never read, the
    thread is joined, and a later caller hashes the given-up file itself."""
    blobs = [_random_file(tmp_path / f"blob{i}") for i in range(3)]
    real = checkpoint.file_sha256
    reads = []

    def until_stopped(path, *, stop=None):  # a read that goes on until the stop: a huge file on a slow disk
        reads.append((path, threading.current_thread().name))
        assert stop is not None and stop.wait(WAIT_S)
        return real(path, stop=stop)  # gives up at its first block

    monkeypatch.setattr(checkpoint, "file_sha256", until_stopped)
    ahead = checkpoint.VerifyAhead(lambda root: checkpoint.hash_files(blobs, threads=2), tmp_path)
    _until(lambda: len(reads) == 2, "two hashes under way")
    ahead.stop()
    assert not ahead.running and ahead.error is None  # given up is not an error
    assert sorted(path for path, _ in reads) == blobs[:2]  # the third was never begun
    assert all(name.startswith("nam-verify-sha256") for _, name in reads)
    assert not [t for t in threading.enumerate() if t.name.startswith("nam-verify")]
    reads.clear()
    monkeypatch.setattr(checkpoint, "file_sha256", lambda path, **kw: reads.append(path) or real(path, **kw))
    assert checkpoint._sha256(blobs[0]) == hashlib.sha256(blobs[0].read_bytes()).hexdigest()
    assert reads == [blobs[0]]


def test_an_error_of_the_background_check_is_kept_unprinted_and_the_callers_own_call_meets_it(
        tmp_path, monkeypatch, capsys):
    blob = _random_file(tmp_path / "blob")
    reads, printed = [], []

    def unreadable(path, **kw):
        reads.append(threading.current_thread().name)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(checkpoint, "file_sha256", unreadable)
    monkeypatch.setattr(threading, "excepthook", printed.append)
    ahead = checkpoint.VerifyAhead(lambda root: checkpoint.good_checkpoints(root) + [checkpoint._sha256(blob)],
                                   tmp_path)
    _until(lambda: not ahead.running, "end of the background check")
    ahead.stop()
    assert isinstance(ahead.error, PermissionError) and reads == ["nam-verify"]
    assert printed == [] and capsys.readouterr() == ("", "")
    with pytest.raises(PermissionError):
        checkpoint._sha256(blob)  # hashed again, here: the same error at the caller's place
    assert reads == ["nam-verify", "MainThread"]
