"""Per-kernel facts of the mimo-scan at NAM56R's bench shape (issue 32's GPU round), for choosing the next design.

    python gpu/mimo_kernels.py [--b 2] [--l 4096]

For each design (``scan.FORWARD`` walk / chunked, ``scan.BACKWARD`` three / fused / split): forward and forward +
backward medians (CUDA events, 5 runs after the autotuned first) and the largest difference of its output and
gradients from the first design's, relative to each tensor's max; then every kernel's autotuner timings per
config (ms), the chosen config, and each compiled variant's registers, spills and shared memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--l", type=int, default=4096)
    a = ap.parse_args()

    from nam_plugin_mimo_scan import kernels, scan
    from nam_plugin_mimo_scan.selftest import ACTIVATIONS, INPUT_NAMES, random_inputs

    h, g = 128, 8
    x = random_inputs(a.b, a.l, h, g, 128, 64, 4, device="cuda", seed=11)
    leaves = {k: (t.to(torch.bfloat16) if k in ACTIVATIONS else t).requires_grad_() for k, t in x.items()}
    args = [leaves[k] if k != "angles" else leaves[k].expand(a.b, a.l, h, -1) for k in INPUT_NAMES]
    dout = torch.randn(a.b, a.l, h, 64, device="cuda", dtype=torch.bfloat16)
    wrt = list(leaves.values())

    def fwd():
        with torch.no_grad():
            return scan.mimo_scan(*args)

    def fwd_bwd():
        out = scan.mimo_scan(*args)
        return (out, *torch.autograd.grad(out, wrt, dout))

    def median_ms(fn, iters=5):
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    first = None
    names = ["out", *(f"d{k}" for k in leaves)]
    for fwd_design, bwd_design in (("walk", "three"), ("chunked", "three"), ("walk", "fused"), ("walk", "split")):
        scan.FORWARD, scan.BACKWARD = fwd_design, bwd_design
        t0 = time.perf_counter()
        result = [t.float() for t in fwd_bwd()]
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
        print(f"forward {fwd_design} backward {bwd_design}: first call {took:.1f} s, fwd {median_ms(fwd):.2f} ms, "
              f"fwd+bwd {median_ms(fwd_bwd):.2f} ms (b={a.b} l={a.l} h={h} g={g})", flush=True)
        if first is None:
            first = result
            continue
        diff = {n: ((w - c).abs().max() / c.abs().max().clamp_min(1e-30)).item()
                for n, w, c in zip(names, result, first)}
        print("  max |diff| / max vs the first:", " ".join(f"{k}={v:.1e}" for k, v in diff.items()), flush=True)
        del result

    for name, kernel in kernels.KERNELS.items():
        timings = getattr(kernel, "configs_timings", None) or {}
        print(f"\n{name}: best {kernel.best_config}")
        for config, ms in timings.items():
            shown = [f"{t:.3f}" for t in (ms if isinstance(ms, list) else [ms])]
            print(f"  {config}: {' '.join(shown)} ms")
        for device, cache in kernel.fn.device_caches.items():
            for compiled in cache[0].values():
                md = compiled.metadata
                print(f"  compiled warps={md.num_warps} stages={md.num_stages} shared={md.shared} "
                      f"regs={getattr(compiled, 'n_regs', '?')} spills={getattr(compiled, 'n_spills', '?')}")
    print("\nshared bytes of the last launches:", scan.SHARED_BYTES)


if __name__ == "__main__":
    main()
