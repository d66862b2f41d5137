"""Format-3 checkpoints (nam_core/engine/async_checkpoint.py): torch.distributed.checkpoint written in the
background in one process without a process group; bit-exact load; what the training thread may change once the
save has returned; integrity by sha256; a crafted index refused without running it; a full disk during the
background write. The kill during the write and the CLI's view are in tests/test_faults.py."""

import gc
import os
import pickle
import threading

import pytest
import torch

from nam_core.engine import async_checkpoint, checkpoint
from nam_core.errors import NamError, RunFolderError


def parts(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)
    return model, optimizer, scheduler


def trained(steps: int = 3):
    model, optimizer, scheduler = parts(1)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for _ in range(steps):
        model(torch.randn(4, 8, generator=g)).square().sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model, optimizer, scheduler


def save(root, step, model, optimizer, scheduler, saver, keep=3):
    pending = checkpoint.start_save(root, step, saver=saver, model=model, optimizer=optimizer, scheduler=scheduler,
                                    extra={"record": {"run": "x"}}, keep=keep)
    return pending


def test_a_background_save_loads_back_bit_exact(tmp_path):
    model, optimizer, scheduler = trained()
    saver = async_checkpoint.AsyncSaver(pinned=False)
    save(tmp_path, 3, model, optimizer, scheduler, saver)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optimizer.state_dict()["state"].values()]
    with torch.no_grad():  # the training thread goes on at once: the save holds its own copy
        for p in model.parameters():
            p.add_(1.0)
    folder = checkpoint.finish_save(saver, tmp_path, model, optimizer)
    manifest = checkpoint.verify(folder)
    assert manifest["format"] == 3 and manifest["step"] == 3 and manifest["record"] == {"run": "x"}
    data = {f"state/__0_{i}.distcp" for i in range(async_checkpoint.FILES)}
    assert "state/.metadata" in manifest["sha256"] and set(manifest["sha256"]) - {"state/.metadata"} <= data
    assert len(manifest["sha256"]) > 2  # several data files, hashed and read side by side

    after = torch.rand(5)  # the generator's next draws, to compare after a load of the state saved before them
    fresh, fresh_opt, fresh_sched = parts(2)
    checkpoint.load(folder, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert torch.equal(torch.rand(5), after)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, expected[name]), name
    for got, want in zip((s["exp_avg"] for s in fresh_opt.state_dict()["state"].values()), moments):
        assert torch.equal(got, want)
    assert fresh_opt.state_dict()["state"][0]["step"].item() == 3
    assert fresh_sched.last_epoch == 3 and fresh_sched.get_last_lr() == pytest.approx([1e-3 * 0.9 ** 3])
    model_only, _ = checkpoint.model_state(folder)
    assert all(torch.equal(model_only[k], v) for k, v in expected.items())


def test_one_save_in_flight_and_the_oldest_pruned(tmp_path):
    model, optimizer, scheduler = trained(1)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    for step in (1, 2, 3):
        save(tmp_path, step, model, optimizer, scheduler, saver, keep=2)  # each waits for the one before
    checkpoint.finish_save(saver, tmp_path, model, optimizer)
    assert [p.name for p in checkpoint.good_checkpoints(tmp_path)] == ["step-00000002", "step-00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]


def test_a_changed_file_is_not_a_good_checkpoint(tmp_path):
    model, optimizer, scheduler = trained(1)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    save(tmp_path, 1, model, optimizer, scheduler, saver)
    folder = checkpoint.finish_save(saver, tmp_path, model, optimizer)
    blob = folder / "state" / "__0_0.distcp"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    assert checkpoint.inspect(folder) == (None, "sha256 mismatch of state/__0_0.distcp (the file changed after it "
                                                "was saved)")
    assert checkpoint.good_checkpoints(tmp_path) == []
    (folder / "state" / "extra.bin").write_bytes(b"x")
    assert "are not the ones its manifest lists" in checkpoint.inspect(folder)[1]


class _Payload:
    """What a crafted index could hold: unpickling it would create ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_index_is_refused_without_running_it(tmp_path):
    """Someone rewrites ``.metadata`` with a pickle that runs code, and the manifest's sha256 to match it: the
    load is refused by the index's unpickler and the payload never runs."""
    model, optimizer, scheduler = trained(1)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    save(tmp_path, 1, model, optimizer, scheduler, saver)
    folder = checkpoint.finish_save(saver, tmp_path, model, optimizer)
    marker = tmp_path / "payload-ran"
    (folder / "state" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    manifest = checkpoint.verify(folder) or {}
    import json

    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["sha256"]["state/.metadata"] = checkpoint.file_sha256(folder / "state" / ".metadata")
    manifest_path.write_text(json.dumps(manifest))
    assert checkpoint.verify(folder) is not None  # the integrity check alone would let it through
    with pytest.raises(RunFolderError, match="is not part of a checkpoint index"):
        checkpoint.load(folder, model=model, optimizer=optimizer, scheduler=scheduler)
    assert not marker.exists()


def test_a_full_disk_during_the_background_write_keeps_the_previous_one(tmp_path, monkeypatch):
    model, optimizer, scheduler = trained(1)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    save(tmp_path, 1, model, optimizer, scheduler, saver)
    monkeypatch.setenv("NAM_TEST_DISK_FULL_DURING_SAVE", "2")
    save(tmp_path, 2, model, optimizer, scheduler, saver)  # returns: the write fails in the background
    with pytest.raises(RunFolderError, match=r"no space left on .*the newest good checkpoint, step-00000001, is "
                                             "intact"):
        checkpoint.finish_save(saver, tmp_path, model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def _flat(folder):
    return {k: v for k, v in async_checkpoint.read_flat(folder).items()}


def test_the_first_save_copies_into_the_buffers_built_in_the_background_bit_exact(tmp_path, monkeypatch):
    """``prepare`` builds the host buffers on another thread; the first save stages into exactly those (no
    allocation of its own), and its checkpoint equals, bit for bit, one saved without ``prepare``."""
    model, optimizer, scheduler = trained()
    built = []
    real = async_checkpoint.host_mirror

    def recording(state, **kw):
        built.append((threading.current_thread().name, real(state, **kw)))
        return built[-1][1]

    monkeypatch.setattr(async_checkpoint, "host_mirror", recording)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    buffers = checkpoint.prepare_save(saver, model=model, optimizer=optimizer, scheduler=scheduler)
    assert buffers.nbytes == sum(t.numel() * t.element_size() for t in async_checkpoint._tensors(
        checkpoint._save_state(model, optimizer, scheduler)))
    rng = torch.get_rng_state()
    pending = save(tmp_path / "a", 3, model, optimizer, scheduler, saver)
    assert [name for name, _ in built] == ["nam-host-buffers"]
    assert saver.stager.state_dict_cache is built[0][1] and pending.buffers is buffers
    assert buffers.built_s is not None and buffers.waited_s >= 0.0
    staged = built[0][1]["model"]
    assert all(torch.equal(staged[k], v) for k, v in model.state_dict().items())  # the copy went into them
    a = checkpoint.finish_save(saver, tmp_path / "a", model, optimizer)
    assert save(tmp_path / "a", 4, model, optimizer, scheduler, saver).buffers is None  # later saves reuse them
    checkpoint.finish_save(saver, tmp_path / "a", model, optimizer)
    assert len(built) == 1

    torch.set_rng_state(rng)  # the same generator state in the second checkpoint
    other = async_checkpoint.AsyncSaver(pinned=False)  # no prepare: the save builds them itself, and says so
    unprepared = save(tmp_path / "b", 3, model, optimizer, scheduler, other)
    assert unprepared.buffers is not None and [name for name, _ in built][1:] == ["nam-host-buffers"]
    b = checkpoint.finish_save(other, tmp_path / "b", model, optimizer)
    flat_a, flat_b = _flat(a), _flat(b)
    assert flat_a.keys() == flat_b.keys() and len(flat_a) > 10
    for key, value in flat_a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == flat_b[key].dtype and torch.equal(value, flat_b[key]), key
        else:
            assert value == flat_b[key], key


def test_a_save_that_comes_before_the_buffers_are_built_waits_for_them(tmp_path, monkeypatch):
    """The first save starts while the background build is still going: it waits for the build to end, stages
    into those buffers, and records the wait (the engine writes it to run.log)."""
    model, optimizer, scheduler = trained()
    gate, events = threading.Event(), []
    real = async_checkpoint.host_mirror

    def slow(state, **kw):
        gate.wait()
        events.append("built")
        return real(state, **kw)

    monkeypatch.setattr(async_checkpoint, "host_mirror", slow)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    checkpoint.prepare_save(saver, model=model, optimizer=optimizer, scheduler=scheduler)
    events.append("save starts")
    threading.Timer(0.2, gate.set).start()
    pending = save(tmp_path, 1, model, optimizer, scheduler, saver)
    assert events == ["save starts", "built"]
    assert pending.buffers is not None and pending.buffers.waited_s > 0.0
    assert pending.stall_s >= pending.buffers.waited_s  # the wait is part of what training paid
    folder = checkpoint.finish_save(saver, tmp_path, model, optimizer)
    assert all(torch.equal(_flat(folder)[f"model.{k}"], v) for k, v in model.state_dict().items())


def test_a_failed_build_fails_the_first_save_naming_the_buffers(tmp_path, monkeypatch):
    model, optimizer, scheduler = trained(1)

    def broken(state, **kw):
        raise RuntimeError("Registering memory failed with cudaError: 2.")

    monkeypatch.setattr(async_checkpoint, "host_mirror", broken)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    checkpoint.prepare_save(saver, model=model, optimizer=optimizer, scheduler=scheduler)
    with pytest.raises(NamError, match=r"the checkpoint host buffers \(0\.0 GB, pageable\) could not be built: "
                                       r"RuntimeError: Registering memory failed") as e:
        save(tmp_path, 1, model, optimizer, scheduler, saver)
    assert "train.async_checkpoints=false" in e.value.hint
    assert list(tmp_path.iterdir()) == []


def test_host_mirror_matches_shapes_and_dtypes_and_refuses_an_unknown_way():
    state = {"a": torch.randn(3, 5), "b": [torch.zeros(0), torch.tensor(7, dtype=torch.int64)], "c": 1.5,
             "d": {"e": torch.randn(2, dtype=torch.bfloat16)}}
    mirror = async_checkpoint.host_mirror(state, pinned=False)
    assert mirror["c"] == 1.5
    for got, want in zip(async_checkpoint._tensors(mirror), async_checkpoint._tensors(state)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.numel() == 0 or got.data_ptr() != want.data_ptr()
    with pytest.raises(ValueError, match="expected 'register' or 'alloc', found 'mmap'"):
        async_checkpoint.host_mirror(state, pinned=True, how="mmap")


def test_registered_host_mirror_locks_each_tensor_on_pages_of_its_own_and_stages_a_save(monkeypatch):
    """``host_mirror(..., how="register")`` (CUDA's calls recorded): the structure of the state, each non-empty
    tensor (0-dim ones too) in one shared mapping on whole pages of its own, registered once, no page in two
    registrations (CUDA refuses a page registered twice; malloc'd tensors share pages); DCP's stager copies a
    state into it value for value."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    registered, unregistered = [], []
    monkeypatch.setattr(async_checkpoint, "_register", lambda ptr, size: registered.append((ptr, size)))
    monkeypatch.setattr(async_checkpoint, "_unregister", unregistered.append)
    gen = torch.Generator().manual_seed(9)
    state = {"w": torch.randn(3, 5, generator=gen), "opt": {"state": {0: {"step": torch.tensor(4.0),
             "exp_avg": torch.randn(17, generator=gen).bfloat16()}}, "groups": [{"lr": 1e-3, "params": [0]}]},
             "pair": (torch.randn(2, generator=gen), 3), "empty": torch.zeros(0), "n": 7}
    mirror = async_checkpoint.host_mirror(state, pinned=True, how="register")
    gc.collect()
    assert unregistered == []  # locked for as long as the mirror lives
    locked = [t for t in async_checkpoint._tensors(mirror) if t.numel()]
    assert len(locked) == 4 and [ptr for ptr, _ in registered] == [t.data_ptr() for t in locked]
    page = async_checkpoint.PAGE
    for (ptr, size), t in zip(registered, locked):
        assert ptr % page == 0 and size % page == 0 and size >= t.numel() * t.element_size()
    spans = sorted(registered)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    stager = BlockingAsyncStager(cache_staged_state_dict=True)
    stager.state_dict_cache = mirror
    staged = stager.stage(state)
    for got, want in zip(async_checkpoint._tensors(staged), async_checkpoint._tensors(state)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert [t.data_ptr() for t in async_checkpoint._tensors(staged) if t.numel()] == [p for p, _ in registered]
    assert staged["n"] == 7 and staged["opt"]["groups"] == [{"lr": 1e-3, "params": [0]}] and staged["pair"][1] == 3
    del mirror, staged, stager, locked, got, want, t
    gc.collect()
    assert sorted(unregistered) == sorted(ptr for ptr, _ in registered)  # and unlocked once it is gone


def test_a_one_file_checkpoint_of_before_loads_and_files_hash_side_by_side_as_one_by_one(tmp_path, monkeypatch):
    """Checkpoints written as one data file (before FILES) still load bit-exact; ``hash_files`` on threads gives
    each file's own sha256."""
    model, optimizer, scheduler = trained()
    monkeypatch.setattr(async_checkpoint, "FILES", 1)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    save(tmp_path, 3, model, optimizer, scheduler, saver)
    folder = checkpoint.finish_save(saver, tmp_path, model, optimizer)
    assert set(checkpoint.verify(folder)["sha256"]) == {"state/.metadata", "state/__0_0.distcp"}
    fresh, fresh_opt, fresh_sched = parts(2)
    checkpoint.load(folder, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())

    from nam_core.data.integrity import file_sha256

    blobs = []
    for i in range(5):
        blobs.append(tmp_path / f"blob{i}")
        blobs[-1].write_bytes(os.urandom(1000 + 37 * i))
    assert checkpoint.hash_files(blobs, threads=4) == {b: file_sha256(b) for b in blobs}


def test_a_write_that_fails_in_any_writer_thread_fails_the_save(tmp_path, monkeypatch):
    """One data file out of several cannot be written (a full disk while writing it): whichever of DCP's writer
    threads wrote it, the save fails with that OSError and leaves no checkpoint (torch 2.13 alone would lose the
    error of a helper thread and write an index without that file's items)."""
    import errno

    from torch.distributed.checkpoint.filesystem import FileSystem

    model, optimizer, scheduler = trained(1)
    real = FileSystem.create_stream
    victim = f"__0_{int.from_bytes(os.urandom(1), 'little') % 3}.distcp"  # files 0-2 exist for this state

    def create_stream(self, path, mode):
        if str(path).endswith(victim):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    save(tmp_path, 1, model, optimizer, scheduler, saver)
    with pytest.raises(RunFolderError, match="no space left on"):
        checkpoint.finish_save(saver, tmp_path, model, optimizer)
    assert list(tmp_path.iterdir()) == []


class _GrowingExtraState(torch.nn.Module):
    """Like Transformer Engine's FP8 modules: its ``_extra_state`` is pickled metadata in a uint8 tensor whose
    length changes between saves."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.meta = {"amax_history": [0.5]}

    def get_extra_state(self):
        return torch.frombuffer(bytearray(pickle.dumps(self.meta)), dtype=torch.uint8)

    def set_extra_state(self, state):
        self.meta = pickle.loads(state.numpy().tobytes())


def test_a_tensor_whose_size_changed_since_the_host_buffers_were_built_is_saved(tmp_path):
    """The host mirror is built from the first save's state; a later save whose extra-state tensor grew must
    still save (it failed in the stager's copy: TE delayed scaling at the end of a run) and load back exactly,
    and the buffers of the tensors that kept their size are reused."""
    model = _GrowingExtraState()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    saver = async_checkpoint.AsyncSaver(pinned=False)
    save(tmp_path, 1, model, optimizer, scheduler, saver)
    checkpoint.finish_save(saver, tmp_path, model, optimizer)
    weight_buffer = saver.stager.state_dict_cache["model"]["lin.weight"]
    model.meta = {"amax_history": [0.5, 0.25, 0.125], "scale": 3.0}
    save(tmp_path, 2, model, optimizer, scheduler, saver)
    folder = checkpoint.finish_save(saver, tmp_path, model, optimizer)
    assert saver.stager.state_dict_cache["model"]["lin.weight"] is weight_buffer
    fresh = _GrowingExtraState()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    checkpoint.load(folder, model=fresh, optimizer=fresh_opt,
                    scheduler=torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda step: 1.0))
    assert fresh.meta == {"amax_history": [0.5, 0.25, 0.125], "scale": 3.0}
    assert torch.equal(fresh.lin.weight, model.lin.weight)


def test_refit_mirror_replaces_only_what_moved():
    state = {"a": torch.zeros(3), "b": {"c": torch.zeros(2, dtype=torch.uint8)}, "n": 4}
    mirror = async_checkpoint.host_mirror(state, pinned=False)
    a = mirror["a"]
    grown = {"a": torch.ones(3), "b": {"c": torch.zeros(5, dtype=torch.uint8), "d": torch.ones(1)}, "n": 5}
    assert async_checkpoint.refit_mirror(mirror, grown, pinned=False) == 2
    assert mirror["a"] is a and mirror["b"]["c"].shape == (5,) and mirror["b"]["d"].shape == (1,)
    assert async_checkpoint.refit_mirror(mirror, grown, pinned=False) == 0
