"""The reference model on one GPU: no host syncs in forward or backward, and the engine trains there.

Marked ``gpu``: skipped with a reason on CPU machines; run on the GPU host with ``python -m pytest -m gpu``.
"""

import pytest
import torch

from nam56r.model import build_model
from nam56r.recipes import get_recipe
from nam56r.state import ForwardState

pytestmark = pytest.mark.gpu


def _batch(cfg, b=2):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len + 1), generator=g).cuda()
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(b, cfg.seq_len, device="cuda"))


def test_dsa_and_mamba3_forward_backward_do_not_sync_with_the_host():
    cfg = get_recipe("nam56r-tiny").model
    model = build_model(cfg, device="cuda")
    batch = _batch(cfg)
    model(**batch)["loss"].backward()
    torch.cuda.synchronize()
    for layer in model.layers:
        if layer.spec.kind not in ("dsa", "mamba"):
            continue
        x = torch.randn(2, cfg.seq_len, cfg.hidden, device="cuda", requires_grad=True)
        state = ForwardState(seq_layout=(2, cfg.seq_len))
        torch.cuda.set_sync_debug_mode("error")
        try:
            y = layer(x, state)
            (y.float().square().mean() + sum(v for vs in state.aux_losses.values() for v in vs)).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_sync_debug_mode_catches_a_sync():
    x = torch.randn(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_matches_cpu_forward_in_fp32():
    """Same weights, same batch: the loss on the GPU equals the CPU's within 1e-3 relative.

    Measured on an H100 (torch 2.11): 1.5e-4 relative. fp32 sums run in other orders over 52 layers and
    two MTP depths; a flipped MoE route or top-k choice would move the loss by far more.
    """
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = get_recipe("nam56r-tiny").model
    torch.manual_seed(0)
    cpu = build_model(cfg, device="cpu")
    gpu = build_model(cfg, device="cuda")
    gpu.load_state_dict(cpu.state_dict())
    batch = _batch(cfg)
    with torch.no_grad():
        a = cpu(**{k: v.cpu() for k, v in batch.items()})["loss"]
        b = gpu(**batch)["loss"].cpu()
    torch.testing.assert_close(a, b, rtol=1e-3, atol=0)
