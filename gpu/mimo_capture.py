"""Where CUDA-graph capture of the mimo-scan breaks (issue 32): one capture attempt per process.

    python gpu/mimo_capture.py STEP MODE [--b B --l L --h H --g G]

STEP: ``geometry`` (the torch prelude only), ``forward``, ``fwdbwd`` (forward + autograd.grad); MODE: the
capture_error_mode (global, thread_local, relaxed). Warms up three times on a side stream (compile, autotune),
captures once, replays, and compares the replay with the eager result bit for bit. Prints one line
``capture STEP MODE: ok|FAIL ...`` and, on a failure, the traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=("geometry", "forward", "fwdbwd"))
    ap.add_argument("mode", choices=("global", "thread_local", "relaxed"))
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--l", type=int, default=256)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--g", type=int, default=2)
    a = ap.parse_args()

    from nam_plugin_mimo_scan import scan
    from nam_plugin_mimo_scan.selftest import ACTIVATIONS, INPUT_NAMES, random_inputs

    x = random_inputs(a.b, a.l, a.h, a.g, 128, 64, 4, device="cuda", seed=7)
    leaves = {k: (t.to(torch.bfloat16) if k in ACTIVATIONS else t).requires_grad_() for k, t in x.items()}

    def args_now():  # the angles' expand made here, on the stream running the step: autograd runs its backward
        # (a sum over heads) on the stream of its forward; made once outside the capture, that is the legacy
        # default stream, and the captured backward failed with cudaErrorStreamCaptureImplicit (2026-11-25)
        return [leaves[k] if k != "angles" else leaves[k].expand(a.b, a.l, a.h, -1) for k in INPUT_NAMES]

    args = args_now()
    wrt = list(leaves.values())
    dout = torch.randn(a.b, a.l, a.h, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        if a.step == "geometry":
            geo = scan._Geometry(args[0], args[2], *args[3:6], args[8], None)
            return (geo.gamma, geo.c, geo.cs, geo.rot)
        if a.step == "forward":
            with torch.no_grad():
                return (scan.mimo_scan(*args_now()),)
        return torch.autograd.grad(scan.mimo_scan(*args_now()), wrt, dout)


    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    print("configs:", scan.CHOSEN, "shared bytes:", scan.SHARED_BYTES, flush=True)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=a.mode):
            static = step()
        graph.replay()
        torch.cuda.synchronize()
    except Exception as e:  # the point of this script: say what broke, with its traceback
        print(f"capture {a.step} {a.mode}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        traceback.print_exc(file=sys.stdout)
        return 1
    same = [torch.equal(e, s) for e, s in zip(eager, static)]
    print(f"capture {a.step} {a.mode}: ok, replay bit-identical to eager: {all(same)} {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
