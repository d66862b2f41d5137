"""Format-3 checkpoints (nam_core/engine/async_checkpoint.py): torch.distributed.checkpoint written in the
background in one process without a process group; bit-exact load; what the training thread may change once the
save has returned; integrity by sha256; a crafted index refused without running it; a full disk during the
background write. The kill during the write and the CLI's view are in tests/test_faults.py."""

import os
import pickle

import pytest
import torch

from nam_core.engine import async_checkpoint, checkpoint
from nam_core.errors import RunFolderError


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
    assert set(manifest["sha256"]) == {"state/.metadata", "state/__0_0.distcp"}

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
