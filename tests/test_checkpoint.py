"""Checkpoints: verified by sha256, corrupt or partial ones are never picked, old ones pruned after a save."""

import pytest
import torch

from nam_core.engine import checkpoint
from nam_core.errors import NamError


def _parts():
    model = torch.nn.Linear(4, 4)
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


def test_resume_auto_without_checkpoints_is_an_error(tmp_path):
    with pytest.raises(NamError, match="no good checkpoint"):
        checkpoint.resolve_resume("auto", tmp_path / "none")
