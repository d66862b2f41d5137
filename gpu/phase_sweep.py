"""The two walks along time of the mimo-scan (``phase``, ``time_grads``) at NAM56R's bench shape, timed per launch
setting (issue 32): tokens a step (``BT``) and warps, against the setting scan.py launches.

    python gpu/phase_sweep.py [--b 2] [--l 4096]

Prints, per kernel and setting, the median of 20 launches (CUDA events) and the largest difference of its outputs
from the launched setting's (a step of another length sums the running phase in another order: fp32 rounding).
"""

from __future__ import annotations

import argparse

import torch

from mimo_kernels import bench_inputs  # this folder: the same inputs as gpu/mimo_kernels.py
from timing import median_ms  # bench/timing.py, on the path through mimo_kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--l", type=int, default=4096)
    a = ap.parse_args()
    from nam_plugin_mimo_scan import scan

    _, args, _ = bench_inputs(a.b, a.l)
    named = dict(zip(scan.INPUT_NAMES, args))
    angles, dt, adt = named["angles"], named["dt"], named["adt"]
    b, l, h, s = angles.shape
    t, nc = scan._tiling(l, named["q"].shape[2], None)
    gen = torch.Generator(device="cuda").manual_seed(13)
    dphase = torch.randn(b, l, h, s, device="cuda", generator=gen)
    dcs = torch.randn(b, h, nc * t, device="cuda", generator=gen)

    def phase(bt, warps):  # scan.py's launch, at another step length and warp count
        return scan._phase_and_decay(angles, dt, adt, t, nc, block=bt, warps=warps)

    def time_grads(bt, warps):
        return scan._time_grads(dphase, dcs, angles, dt, block=bt, warps=warps)

    for name, fn, launched in (("phase", phase, (max(scan.TIME_BLOCK, t), 4)),
                               ("time_grads", time_grads, (scan.TIME_BLOCK, 4))):
        ref = fn(*launched)
        for bt in (64, 128, 256):
            for warps in (4, 8):
                out = fn(bt, warps)
                diff = max((x - y).abs().max().item() for x, y in zip(out, ref))
                ms = median_ms(lambda: fn(bt, warps), warmup=3, iters=20)
                mark = " (launched)" if (bt, warps) == launched else ""
                print(f"{name} BT {bt} warps {warps}: {ms:.3f} ms, max diff from launched {diff:.2e}{mark}",
                      flush=True)


if __name__ == "__main__":
    main()
