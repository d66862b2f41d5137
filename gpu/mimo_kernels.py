"""Per-kernel facts of the mimo-scan at NAM56R's bench shape (issue 32's GPU round), for choosing the next design.

    python gpu/mimo_kernels.py [--b 2] [--l 4096] [--block-t T] [--ph PH] [--bwd-configs W,S[,NS[,R]] ...]
        [--chunk-configs W,S[,R] ...] [--walk-configs W,S[,PSPLIT[,R]] ...] [--unchecked-per-head]

The first call (compile + autotune) against the second, bit for bit (a timed run must leave no trace); forward
and forward + backward medians (CUDA events, 5 runs); then every kernel's autotuner timings per config (ms),
the chosen config, and each compiled variant's registers, spills and shared memory. ``--block-t`` (tokens per
tile), ``--ph`` (``scan.COLUMN_BLOCKS``) and ``--bwd-configs`` (the backward's autotune list as
warps,stages[,NS[,R]] in place of ``kernels.CONFIGS["bwd"]``; NS: dq / dk in windows of n's columns; R: a cap
on the registers a thread, Triton's ``maxnreg``, 0 for none; ``kernels._fits`` still decides which pass may take
which, unless ``--unchecked-per-head`` lets the per-head pass take any) and ``--chunk-configs`` (the same for
``fwd_chunk``) and ``--walk-configs`` (both walks', PSPLIT 1 unless given) try other launch settings. The inputs
and the output gradient are seeded, so the digest compares two runs (two configs, or two kernel versions) bit for
bit.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from timing import median_ms  # noqa: E402 (bench/timing.py: the benches' CUDA-event median)


HEADS, GROUPS = 128, 8
"""NAM56R's Mamba-3 heads and groups (d_state 128, headdim 64, rank 4 in ``bench_inputs``)."""


def bench_inputs(b: int, l: int):
    """The scan's inputs at NAM56R's widths on the GPU, seed 11: ``(leaves by name, the scan's arguments in
    order (the angles expanded over the heads), a bf16 output gradient)``; activations bf16, parameters fp32."""
    from nam_plugin_mimo_scan.selftest import ACTIVATIONS, INPUT_NAMES, random_inputs

    x = random_inputs(b, l, HEADS, GROUPS, 128, 64, 4, device="cuda", seed=11)
    leaves = {k: (t.to(torch.bfloat16) if k in ACTIVATIONS else t).requires_grad_() for k, t in x.items()}
    args = [leaves[k] if k != "angles" else leaves[k].expand(b, l, HEADS, -1) for k in INPUT_NAMES]
    gen = torch.Generator(device="cuda").manual_seed(12)
    return leaves, args, torch.randn(b, l, HEADS, 64, device="cuda", dtype=torch.bfloat16, generator=gen)


def _label(name: str, meta: dict) -> str:
    """A launch's name with the pass flags set in it, e.g. ``bwd[DQ]``."""
    flags = "".join(k for k, v in meta.items() if v is True)
    return f"{name}[{flags}]" if flags else name


def _ints(text: str, *defaults: int) -> tuple[int, ...]:
    """``"4,2"`` with defaults ``1, 0`` -> ``(4, 2, 1, 0)``: warps, stages, then the optional fields given or not."""
    given = [int(v) for v in text.split(",")]
    return (*given, *defaults[len(given) - 2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--l", type=int, default=4096)
    ap.add_argument("--block-t", type=int, default=None)
    ap.add_argument("--ph", type=int, default=None)
    ap.add_argument("--bwd-configs", nargs="+", default=None, metavar="WARPS,STAGES[,NS[,MAXNREG]]")
    ap.add_argument("--chunk-configs", nargs="+", default=None, metavar="WARPS,STAGES[,MAXNREG]")
    ap.add_argument("--walk-configs", nargs="+", default=None, metavar="WARPS,STAGES[,PSPLIT[,MAXNREG]]")
    ap.add_argument("--unchecked-per-head", action="store_true",
                    help="offer the per-head pass every --bwd-configs config at NS 1, not only "
                         "kernels.PER_HEAD_CONFIGS: for timing; check the chosen one with gpu/mimo_fault.py")
    ap.add_argument("--keep-states", action="store_true",
                    help="the forward keeps S_in and the phase table for the backward (scan.mimo_scan's "
                         "keep_states): the backward runs no state walk and no phase kernel; checks its result "
                         "bit for bit against a call that keeps nothing")
    a = ap.parse_args()

    from nam_plugin_mimo_scan import kernels, scan

    if a.ph is not None:
        scan.COLUMN_BLOCKS = a.ph
    def offer(name, kernel, configs):  # a kernel's autotune list replaced, and the kernel wrapped again over it
        kernels.CONFIGS[name] = configs
        kernels.KERNELS[name] = kernels._tuned(name, kernel)

    if a.bwd_configs:  # NS 1 and MAXNREG 0 (no cap) unless given
        offer("bwd", kernels.bwd_kernel, [kernels._config(w, st, r or None, NS=ns) for w, st, ns, r in
                                          (_ints(c, 1, 0) for c in a.bwd_configs)])
        if a.unchecked_per_head:
            kernels.PER_HEAD_CONFIGS = {(c.num_warps, c.num_stages, c.maxnreg) for c in kernels.CONFIGS["bwd"]}
    if a.chunk_configs:
        offer("fwd_chunk", kernels.fwd_chunk_kernel, [kernels._config(w, st, r or None) for w, st, r in
                                                      (_ints(c, 0) for c in a.chunk_configs)])
    if a.walk_configs:
        for name, kernel in (("state_walk", kernels.state_walk_kernel), ("dstate_walk", kernels.dstate_walk_kernel)):
            offer(name, kernel, [kernels._config(w, st, r or None, PSPLIT=ps) for w, st, ps, r in
                                 (_ints(c, 1, 0) for c in a.walk_configs)])
    print(f"block_t {a.block_t or scan.tile_tokens(4)}, states kept {a.keep_states}, PH {scan.COLUMN_BLOCKS}, "
          f"bwd configs "
          f"{[(c.num_warps, c.num_stages, c.kwargs.get('NS'), c.maxnreg) for c in kernels.CONFIGS['bwd']]}, "
          f"per-head {sorted(kernels.PER_HEAD_CONFIGS, key=str)}, fwd_chunk configs "
          f"{[(c.num_warps, c.num_stages, c.maxnreg) for c in kernels.CONFIGS['fwd_chunk']]}, walk configs "
          f"{[(c.num_warps, c.num_stages, c.kwargs.get('PSPLIT'), c.maxnreg) for c in kernels.CONFIGS['state_walk']]}",
          flush=True)
    h, g = HEADS, GROUPS
    leaves, args, dout = bench_inputs(a.b, a.l)
    wrt = list(leaves.values())

    def fwd():
        with torch.no_grad():
            return scan.mimo_scan(*args, block_t=a.block_t)

    def fwd_bwd(keep=a.keep_states or None):
        out = scan.mimo_scan(*args, block_t=a.block_t, keep_states=keep)
        return (out, *torch.autograd.grad(out, wrt, dout))

    names = ["out", *(f"d{k}" for k in leaves)]
    tuned, real_launch = {}, scan._launch

    def tuning_launch(name, grid, *args, **meta):  # every pass's timings (the tuner keeps the last shape's only)
        compiled = real_launch(name, grid, *args, **meta)
        tuned[_label(name, meta)] = dict(getattr(kernels.KERNELS[name], "configs_timings", {}))
        return compiled

    scan._launch = tuning_launch
    t0 = time.perf_counter()
    first = [t.float() for t in fwd_bwd()]  # compiles and autotunes every kernel
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    scan._launch = real_launch
    for label, timings in tuned.items():
        for config, ms in timings.items():
            ms = ms if isinstance(ms, list) else [ms]
            print(f"tuned {label} {config}: {ms[0]:.3f} ms")
    second = [t.float() for t in fwd_bwd()]
    same = {n: torch.equal(x, y) for n, x, y in zip(names, first, second)}
    print(f"first call {took:.1f} s; tuning left every tensor bit-identical to the next call: {all(same.values())} "
          f"{[n for n, v in same.items() if not v]}", flush=True)
    # a digest of every result, so that two runs (two kernel variants, same inputs) can be compared bit for bit
    digest = hashlib.sha1(b"".join(t.detach().cpu().numpy().tobytes() for t in second)).hexdigest()[:16]
    print(f"digest of the output and every gradient: {digest}", flush=True)
    if a.keep_states:  # the same inputs through a call that keeps nothing: the kept states must change no bit
        plain = [t.float() for t in fwd_bwd(keep=False)]
        same = [n for n, x, y in zip(names, second, plain) if not torch.equal(x, y)]
        print(f"states kept: bit-identical to a call that walks again in its backward: {not same} {same}", flush=True)
    fwd_ms, fwd_bwd_ms = (median_ms(f, warmup=0, iters=5) for f in (fwd, fwd_bwd))
    print(f"fwd {fwd_ms:.2f} ms, fwd+bwd {fwd_bwd_ms:.2f} ms (b={a.b} l={a.l} h={h} g={g})", flush=True)

    # each launch timed with CUDA events (the profiler lumps the three bwd passes under one name)
    events = {}

    def timed(label, call):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = call()
        end.record()
        events.setdefault(label, []).append((start, end))
        return out

    real_phase, real_time_grads = scan._phase_and_decay, scan._time_grads

    def timed_launch(name, grid, *args, **meta):
        return timed(_label(name, meta), lambda: real_launch(name, grid, *args, **meta))

    def timed_call(label, fn):  # the walks along time launch directly, not through scan._launch
        return lambda *args, **kwargs: timed(label, lambda: fn(*args, **kwargs))

    scan._launch = timed_launch
    scan._phase_and_decay = timed_call("phase", real_phase)
    scan._time_grads = timed_call("time_grads", real_time_grads)
    for _ in range(5):
        fwd_bwd()
    torch.cuda.synchronize()
    scan._launch, scan._phase_and_decay, scan._time_grads = real_launch, real_phase, real_time_grads
    for name, pairs in events.items():
        print(f"launch {name}: {statistics.median(s.elapsed_time(e) for s, e in pairs):.3f} ms (median of "
              f"{len(pairs)})")

    for name, kernel in kernels.KERNELS.items():
        timings = getattr(kernel, "configs_timings", None) or {}
        print(f"\n{name}: best {kernel.best_config}")
        for key, config in getattr(kernel, "cache", {}).items():  # the choice for each shape and pass
            print(f"  chosen for {key}: {config}")
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
