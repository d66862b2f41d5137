"""Which backward launch config faults at 32-token tiles (r30: an illegal address while the tuner timed the
``bwd`` kernel in the parity test with g=8, block_t=32). The given config for one pass (CHUNK, DQ or DK; NS: dq / dk
in windows of n's columns), 4 warps, 1 stage, NS 1 for the others, the prune rule bypassed; one process per config
(a fault ends the CUDA context):

    CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py WARPS STAGES [--pass CHUNK] [--ns 1] [--block-t 32] [--maxnreg R]

Prints ``ok`` with the worst error against the fp32 reference, or dies with the CUDA error.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("warps", type=int)
    ap.add_argument("stages", type=int)
    ap.add_argument("--pass", dest="flag", choices=("CHUNK", "DQ", "DK"), default="CHUNK")
    ap.add_argument("--ns", type=int, default=1)
    ap.add_argument("--block-t", type=int, default=32)
    ap.add_argument("--maxnreg", type=int, default=None, help="the given config's cap on registers a thread")
    a = ap.parse_args()
    from nam_plugin_mimo_scan import kernels
    from nam_plugin_mimo_scan.selftest import compare

    given, other = kernels._config(a.warps, a.stages, a.maxnreg, NS=a.ns), kernels._config(4, 1, NS=1)
    kernels.CONFIGS["bwd"] = [given, other]
    kernels._fits = lambda configs, nargs, **kw: [given if kw.get(a.flag) else other]
    kernels.KERNELS["bwd"] = kernels._tuned("bwd", kernels.bwd_kernel)
    errors = compare(1, 1000, 128, 8, 128, 64, 4, device="cuda", dtype=torch.bfloat16, block_t=a.block_t,
                     norms=True)
    torch.cuda.synchronize()
    worst = max(v for v in errors.values() if isinstance(v, float))
    print(f"ok {a.flag} warps={a.warps} stages={a.stages} maxnreg={a.maxnreg} NS={a.ns} block_t={a.block_t}: "
          f"worst relative error {worst:.2e}")


if __name__ == "__main__":
    main()
