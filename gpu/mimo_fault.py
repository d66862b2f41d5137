"""Whether one backward launch config of one pass (CHUNK, DQ or DK; NS: dq / dk in windows of n's columns) computes
right and stays in bounds, against the fp32 reference at b1, l=1000 (a ragged last chunk), 128 heads in 8 groups:
the other two passes at the configs the tuner takes on an H200 (``SHIPPED``), the prune rule bypassed; one process
per config (a fault ends the CUDA context). Under Compute Sanitizer (``compute-sanitizer --tool memcheck
--kernel-name kns=bwd_kernel``) it says which line reads out of range:

    CUDA_LAUNCH_BLOCKING=1 python gpu/mimo_fault.py WARPS STAGES [--pass CHUNK] [--ns 1] [--block-t 32] [--maxnreg R]

Prints ``ok`` with the worst error against the fp32 reference, or dies with the CUDA error. Until r63 the other
passes ran at 4 warps with 1 stage, NS 1: the per-head pass at that config reads shared memory out of range at
16-token tiles (r63's memcheck, kernels.py's ``_head_cols``), so r62's dq and dk "faults" at 3 stages were the
per-head pass's; it is not a config the tuner offers that pass (``kernels.PER_HEAD_CONFIGS``).
"""

from __future__ import annotations

import argparse

import torch


SHIPPED = {"CHUNK": (4, 2, 168, 1), "DQ": (4, 2, None, 2), "DK": (4, 2, None, 2)}
"""(warps, stages, maxnreg, NS) each ``bwd`` pass took on an H200 at NAM56R's b2 (r61's tuner; since r64 dq takes 3
stages at 16-token tiles, which ``4 3 --pass DQ --ns 2 --block-t 16`` checks: 2 stages stay offered to it)."""


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

    shipped = {flag: kernels._config(w, st, r, NS=ns) for flag, (w, st, r, ns) in SHIPPED.items()}

    given = kernels._config(a.warps, a.stages, a.maxnreg, NS=a.ns)
    chosen = {flag: given if flag == a.flag else config for flag, config in shipped.items()}
    kernels.CONFIGS["bwd"] = list(chosen.values())
    kernels._fits = lambda configs, nargs, **kw: [next(c for f, c in chosen.items() if kw.get(f))]
    kernels.KERNELS["bwd"] = kernels._tuned("bwd", kernels.bwd_kernel)
    errors = compare(1, 1000, 128, 8, 128, 64, 4, device="cuda", dtype=torch.bfloat16, block_t=a.block_t,
                     norms=True)
    torch.cuda.synchronize()
    worst = max(v for v in errors.values() if isinstance(v, float))
    print(f"ok {a.flag} warps={a.warps} stages={a.stages} maxnreg={a.maxnreg} NS={a.ns} block_t={a.block_t}: "
          f"worst relative error {worst:.2e}")


if __name__ == "__main__":
    main()
