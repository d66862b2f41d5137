"""What building the checkpoint host buffers on a background thread costs the training thread, on one GPU, for
the two ways of page-locking them (nam_core/engine/async_checkpoint.py ``host_mirror``): ``alloc``
(``cudaHostAlloc`` through torch's pinned allocator: what DCP's ``BlockingAsyncStager`` does at its first stage,
nam's ``HOST_BUFFERS`` now) and ``register`` (pageable tensors, pages touched, ``cudaHostRegister`` per tensor).
A way whose build fails (the driver refusing a range as already registered, say) is reported as such.

    python bench/host_buffers.py [--gb 27] [--tensors 1500] [--ways register,alloc] [--json FILE]

Per way, in a process of its own (torch's pinned allocator keeps what it allocated): a synthetic state of
``--gb`` GB on the GPU (bf16 and fp32 tensors of log-uniform sizes, the largest ~1/16 of the total: NAM56R's
embedding and its moments), then a stand-in for training on the main thread (a bf16 8192^3 matmul and a
synchronize, ~1-2 ms on an H100/H200, timed one by one): first alone, then while ``AsyncSaver.prepare`` builds the
buffers on its thread; then the first save's copy into the buffers, as ``BlockingAsyncStager.stage`` does it.
Prints per way: the build's time, the training stand-in's median and worst iteration alone and during the build,
the time the training thread lost during the build (sum of the iterations' excess over the median alone), and
the copy's time and GB/s. 27 GB: one bf16-numerics NAM56R checkpoint; needs that much host RAM per way and
~30 GB of GPU memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def synthetic_state(gb: float, n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    weights = torch.exp(torch.rand(n, generator=g) * 9.0)  # log-uniform over ~4 decades
    weights[0] = weights.sum() / 15  # one ~1/16 of the total, as NAM56R's embedding
    sizes = (weights / weights.sum() * gb * 1e9).long()
    state = {}
    for i, nbytes in enumerate(sizes.tolist()):
        dtype = torch.bfloat16 if i % 3 == 0 else torch.float32  # params bf16, moments fp32 (bf16 numerics)
        state[f"t{i}"] = torch.empty(max(1, nbytes // dtype.itemsize), dtype=dtype, device="cuda")
    state["step"] = torch.tensor(1.0)
    return state


def one_way(way: str, gb: float, n: int) -> dict:
    from torch.distributed._state_dict_utils import _copy_state_dict

    from nam_core.engine import async_checkpoint

    async_checkpoint.HOST_BUFFERS = way
    state = synthetic_state(gb, n)
    total = sum(t.numel() * t.element_size() for t in state.values())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def iteration() -> float:
        t0 = time.perf_counter()
        a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(20):
        iteration()
    alone = sorted(iteration() for _ in range(200))
    median = alone[len(alone) // 2]
    saver = async_checkpoint.AsyncSaver(pinned=True)
    t0 = time.perf_counter()
    saver.prepare(state)
    during = []
    while not saver._built.done():
        during.append(iteration())
    built = time.perf_counter() - t0
    saver._built.result()  # a failed build raises here
    mirror = saver._built.result()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    _copy_state_dict(state, mirror)  # the first save's stall from now on
    torch.cuda.synchronize()
    copy = time.perf_counter() - t1
    return {"way": way, "gb": total / 1e9, "tensors": len(state), "build_s": built,
            "alone_median_ms": median * 1e3, "alone_max_ms": alone[-1] * 1e3,
            "during_median_ms": sorted(during)[len(during) // 2] * 1e3 if during else None,
            "during_max_ms": max(during) * 1e3 if during else None, "during_iterations": len(during),
            "lost_s": sum(max(0.0, d - median) for d in during), "copy_s": copy, "copy_gb_per_s": total / 1e9 / copy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=27.0)
    ap.add_argument("--tensors", type=int, default=1500)
    ap.add_argument("--ways", type=lambda s: s.split(","), default=["alloc", "register"])
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process of one way
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_way(args.one, args.gb, args.tensors)))
        return 0
    rows = []
    for way in args.ways:
        out = subprocess.run([sys.executable, __file__, "--one", way, "--gb", str(args.gb), "--tensors",
                              str(args.tensors)], capture_output=True, text=True)
        if out.returncode:  # the other way still runs: a failed build is a finding
            print(f"error: the {way} way exited with {out.returncode}:\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| way | GB | build s (background) | matmul ms alone: median, max | during the build: median, max "
          "(n) | training time lost during the build s | first copy s (GB/s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['way']} | {r['gb']:.1f} | {r['build_s']:.1f} | {r['alone_median_ms']:.2f}, "
              f"{r['alone_max_ms']:.2f} | {r['during_median_ms'] or 0:.2f}, {r['during_max_ms'] or 0:.1f} "
              f"({r['during_iterations']}) | {r['lost_s']:.2f} | {r['copy_s']:.2f} ({r['copy_gb_per_s']:.1f}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if len(rows) == len(args.ways) else 1


if __name__ == "__main__":
    sys.exit(main())
