"""Per-pass CUDA-event timings of the MIMO scan at a given shape (the plugin's own measurement; the lead's
``bench/mimo_scan.py`` imports ``scan.forward_backward`` or this).

Forward, backward (``torch.autograd.grad`` of the saved graph, gradients of every input) and forward +
backward are each timed with CUDA events around one call, median of ``iters`` after ``warmup`` calls; peak
memory is ``torch.cuda.max_memory_allocated`` over one forward + backward, minus what was allocated before.
"""

from __future__ import annotations

import statistics

import torch

NAM56R_SHAPE = dict(b=2, l=4096, h=128, g=8, n=128, p=64, r=4)
"""The issue's shape: NAM56R's Mamba-3 layers at sequence 4096, batch 2."""


def _median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_passes(*, b=2, l=4096, h=128, g=8, n=128, p=64, r=4, block_t=None, warmup=3, iters=20,
                seed=0) -> dict:
    """``{"fwd_ms", "bwd_ms", "total_ms", "peak_gib", "shared_bytes"}`` on the current CUDA device, bf16."""
    from nam_plugin_mimo_scan import scan
    from nam_plugin_mimo_scan.selftest import ACTIVATIONS, INPUT_NAMES, random_inputs

    x = random_inputs(b, l, h, g, n, p, r, device="cuda", seed=seed)
    leaves = {k: (t.to(torch.bfloat16) if k in ACTIVATIONS else t).requires_grad_() for k, t in x.items()}
    args = [leaves[k] if k != "angles" else leaves[k].expand(b, l, h, -1) for k in INPUT_NAMES]
    wrt = [leaves[k] for k in INPUT_NAMES]
    dout = torch.randn(b, l, h, p, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return scan.mimo_scan(*args, block_t=block_t)

    def fwd_bwd():
        torch.autograd.grad(fwd(), wrt, dout)

    fwd_ms = _median_ms(lambda: fwd(), warmup, iters)
    total_ms = _median_ms(fwd_bwd, warmup, iters)
    bwd_times = []
    for i in range(warmup + iters):
        out = fwd()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(out, wrt, dout)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            bwd_times.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"fwd_ms": fwd_ms, "bwd_ms": statistics.median(bwd_times), "total_ms": total_ms,
            "peak_gib": peak / 2**30, "shared_bytes": dict(scan.SHARED_BYTES), "block_t": block_t or
            scan.tile_tokens(r), "shape": dict(b=b, l=l, h=h, g=g, n=n, p=p, r=r)}
