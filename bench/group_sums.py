"""Benchmark: the mamba-ssm MIMO backward's group and bias sums of one per-head gradient at NAM56R's MBS 4 shape
([4, 4096, 4, 128, 128] bf16, 8 groups: 2.15 GB read), eager torch (``mimo.reduce_groups``: two reductions, two
reads) against nam's one-read Triton kernel (``group_sums.fused_reduce_groups``) at its ``TILE`` and, with
``--sweep``, at every tile of ``SWEEP``. One table: median CUDA-event ms, the bytes moved per ms (GB/s: the
gradient read twice by eager and once by the kernel, plus the group sums written), the ratio to eager from the same run, and each kernel's largest
error against eager (bias: max |a - b| / max |b|; group sums: relative L2)::

    python bench/group_sums.py [--sweep] [--json bench/results/group_sums.json]

The 34 calls a step (17 Mamba-3 layers x dQ, dK) times the difference is what a step saves.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from timing import median_ms

from nam56r.config import NAM56RConfig
from nam_core.testing import max_rel_error, rel_norm_error

B, L = 4, 4096
CALLS = 34
SWEEP = [tile for tile in itertools.product((128, 256, 512), (2, 4, 8), (4, 8), (1, 3))]
"""(CHUNK, BT, warps, stages) tiles ``--sweep`` times."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true", help="time every tile of SWEEP, not TILE alone")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/group_sums.py needs a CUDA GPU (the kernel is Triton); none is visible", file=sys.stderr)
        return 2
    from nam_plugin_mamba_ssm import mimo
    from nam_plugin_mamba_ssm.group_sums import TILE, fused_reduce_groups

    cfg = NAM56RConfig()
    g = cfg.mamba_ngroups
    d = torch.randn(B, L, cfg.mamba_mimo_rank, cfg.mamba_heads, cfg.d_state, device="cuda", dtype=torch.bfloat16)
    grad_bytes, written = d.numel() * d.element_size(), d.numel() * d.element_size() / (cfg.mamba_heads // g)
    moved = {"eager": 2 * grad_bytes + written, "fused": grad_bytes + written}  # reads, plus the group sums written
    want_bias, want_grouped = mimo.reduce_groups(d, g)
    eager = median_ms(lambda: mimo.reduce_groups(d, g), warmup=args.warmup, iters=args.iters)
    rows = [{"form": "eager (torch, two reads)", "tile": None, "ms": eager, "ratio": 1.0, "bias_err": 0.0,
             "grouped_err": 0.0}]
    for tile in (SWEEP if args.sweep else [TILE]):
        bias, grouped = fused_reduce_groups(d, g, tile=tile)
        ms = median_ms(lambda: fused_reduce_groups(d, g, tile=tile), warmup=args.warmup, iters=args.iters)
        rows.append({"form": "nam fused (Triton, one read)", "tile": list(tile), "ms": ms, "ratio": eager / ms,
                     "bias_err": max_rel_error(bias, want_bias), "grouped_err": rel_norm_error(grouped, want_grouped)})
    print(f"\n{torch.cuda.get_device_name()}, [{B}, {L}, {cfg.mamba_mimo_rank}, {cfg.mamba_heads}, {cfg.d_state}] "
          f"bf16, {g} groups; TILE = {TILE} (CHUNK, BT, warps, stages)\n")
    print("| form | tile (CHUNK, BT, warps, stages) | ms | GB/s | vs eager | ms a step (x34) | bias err | group err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        gbs = moved["fused" if r["tile"] else "eager"] / r["ms"] / 1e6
        print(f"| {r['form']} | {r['tile'] or '-'} | {r['ms']:.3f} | {gbs:,.0f} | {r['ratio']:.2f}x | "
              f"{r['ms'] * CALLS:.1f} | {r['bias_err']:.1e} | {r['grouped_err']:.1e} |")
    best = max(rows[1:], key=lambda r: r["ratio"])
    print(f"\nfastest tile: {best['tile']} ({best['ms']:.3f} ms, {best['ratio']:.2f}x eager)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tile": list(TILE),
                       "rows": rows}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
