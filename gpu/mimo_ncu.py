"""One forward + backward of the mimo-scan at NAM56R's bench shape, with CUDA's profiler range around it only,
for Nsight Compute (issue 32: where each kernel's time goes, by its hardware counters):

    ncu --profile-from-start off --clock-control none --section ... python gpu/mimo_ncu.py [--b 2] [--l 4096]

The first call (compile + autotune) runs outside the range, so ncu replays only the launches of the second.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--l", type=int, default=4096)
    a = ap.parse_args()

    from mimo_kernels import bench_inputs  # this folder: the same inputs as gpu/mimo_kernels.py
    from nam_plugin_mimo_scan import scan

    leaves, args, dout = bench_inputs(a.b, a.l)

    def fwd_bwd():
        out = scan.mimo_scan(*args)
        torch.autograd.grad(out, list(leaves.values()), dout)

    fwd_bwd()  # compile and autotune, unprofiled
    torch.cuda.synchronize()
    print("chosen:", scan.CHOSEN, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    fwd_bwd()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
