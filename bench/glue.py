"""Benchmark: the memory-bound glue between NAM56R's kernels, each region eager against compiled (``torch.compile``,
inductor: nam56r/regions.py), on one GPU at the full model's MBS 4 shapes (b 4 x 4096 tokens), as one table.

Rows (the regions bench/results/glue.md ranks; ``calls`` is how many times a 52-layer step at
``train.recompute=mamba-scan`` runs each: 17 Mamba-3 layers, 22 MoE layers):

* ``moe gather-sum``: a token's 4 sorted rows summed back (``nam56r.experts.gather_sum``, [65536, 4096] bf16 ->
  [16384, 4096]): the combine's forward and the dispatch's backward, 44 calls. Also timed: torch's
  ``F.embedding_bag(mode="sum")``, the one eager op that gathers and sums in one kernel (its "compiled ms" column;
  not wired into the model).
* ``moe gated swiglu``: ``silu(gate) * up * g`` on [65536, 320] bf16, forward + backward, 22 calls.
* ``mimo reduce-groups``: the mamba-ssm MIMO backward's bias and group sums of one per-head gradient
  ([4, 4096, 4, 128, 128] bf16, 8 groups; ``nam_plugin_mamba_ssm.mimo.reduce_groups``), 34 calls (dQ and dK);
  also against the Triton kernel that reads the gradient once (``group_sums.py``, ``mamba-ssm.group_sums=fused``:
  its "compiled ms" column is that kernel).
* ``mamba prelude``: the mixer's elementwise region (``nam56r.blocks.mamba3.mamba3_prelude``; the nam56r recipe
  already compiles it, ``mamba_compile_prelude``), forward + backward (17 calls) and forward alone (the
  ``mamba-scan`` replay, 17 calls).
* ``mamba v, z copies``: the contiguous copies of x and z the MIMO kernels read (``kernel_args.mimo_args``), eager
  only: no compiled region removes them (68 calls with the replay).
* ``mamba in_proj + z, x copies``: in_proj (16384 x 4096 -> 24992) and the two copies, forward + backward, against
  three GEMMs on row slices of its weight (``mamba_split_in_proj``: its "compiled ms" column), 17 calls; the
  split also removes the replay's two copies (34 more calls of the row above).

Each row: median CUDA-event ms of eager and compiled, their ratio, the ms a step would save (difference x calls),
and the compiled output's largest error against eager (max |a - b| / max |b|)::

    python bench/glue.py --json bench/results/glue.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from timing import median_ms

from nam56r.config import NAM56RConfig
from nam_core.testing import max_rel_error

B, L = 4, 4096  # MBS 4 x sequence 4096: the profiled step (bench/results/profiles/local-1gpu-h200-mbs4-*)
MAMBA_LAYERS, MOE_LAYERS = 17, 22  # NAM56R's 52-layer pattern (nam56r/pattern.py)


def fwd_bwd(fn, inputs: list[torch.Tensor], grads: list[torch.Tensor]):
    """A callable running ``fn(*inputs)`` forward and backward with ``grads`` (the float outputs' gradients)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]

    def step():
        for t in leaves:
            t.grad = None
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        used = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        torch.autograd.backward([o for o, _ in used], [g for _, g in used])
        return outs

    return step


def moe_rows(dev):
    from nam56r.experts import COMPILED_ROWS, EAGER_ROWS

    cfg = NAM56RConfig()
    k, d, f = cfg.moe_topk, cfg.hidden, cfg.moe_ffn_hidden
    t = B * L
    rows = torch.randn(t * k, d, device=dev, dtype=torch.bfloat16)
    index = torch.randperm(t * k, device=dev)
    bags = index.view(t, k)
    yield ("moe gather-sum", 2 * MOE_LAYERS, lambda: EAGER_ROWS.gather_sum(rows, index, k),
           lambda: COMPILED_ROWS.gather_sum(rows, index, k))
    yield ("moe gather-sum: embedding_bag", 2 * MOE_LAYERS, lambda: EAGER_ROWS.gather_sum(rows, index, k),
           lambda: F.embedding_bag(bags, rows, mode="sum"))
    h = torch.randn(t * k, 2 * f, device=dev, dtype=torch.bfloat16)
    gates = torch.rand(t * k, device=dev, dtype=torch.bfloat16)
    dy = [torch.randn(t * k, f, device=dev, dtype=torch.bfloat16)]
    yield ("moe gated swiglu fwd+bwd", MOE_LAYERS, fwd_bwd(EAGER_ROWS.gated_swiglu, [h, gates], dy),
           fwd_bwd(COMPILED_ROWS.gated_swiglu, [h, gates], dy))


def mimo_rows(dev):
    from nam_plugin_mamba_ssm import mimo

    cfg = NAM56RConfig()
    d = torch.randn(B, L, cfg.mamba_mimo_rank, cfg.mamba_heads, cfg.d_state, device=dev, dtype=torch.bfloat16)
    g = cfg.mamba_ngroups
    yield ("mimo reduce-groups", 2 * MAMBA_LAYERS, lambda: mimo.reduce_groups(d, g),
           lambda: mimo.COMPILED_REDUCE(d, g))
    from nam_plugin_mamba_ssm.group_sums import fused_reduce_groups

    yield ("mimo reduce-groups: fused triton", 2 * MAMBA_LAYERS, lambda: mimo.reduce_groups(d, g),
           lambda: fused_reduce_groups(d, g))


def mamba_rows(dev):
    from nam56r.blocks.mamba3 import BC_NORM_EPS, Mamba3Mixer, compiled_prelude, mamba3_prelude

    cfg = NAM56RConfig()
    with torch.device(dev):
        m = Mamba3Mixer(cfg, scan=None).to(torch.bfloat16)  # D, dt_bias, B_bias, C_bias stay fp32
    proj = torch.randn(B, L, sum(m.split_sizes), device=dev, dtype=torch.bfloat16)
    params = [m.dt_bias, m.B_bias, m.C_bias, m.B_norm.weight, m.C_norm.weight, m.D]
    const = (m.split_sizes, (m.rank, m.groups, m.d_state, m.heads, m.headdim), cfg.mamba_a_floor, BC_NORM_EPS)

    def region(fn):
        return lambda *t: fn(*t, *const)

    outs = mamba3_prelude(proj, *params, *const)
    grads = [torch.randn_like(o) for o in outs]
    inputs = [proj, *(p.detach() for p in params)]
    yield ("mamba prelude fwd+bwd", MAMBA_LAYERS, fwd_bwd(region(mamba3_prelude), inputs, grads),
           fwd_bwd(region(compiled_prelude()), inputs, grads))
    yield ("mamba prelude fwd (replay)", MAMBA_LAYERS, lambda: mamba3_prelude(proj, *params, *const),
           lambda: compiled_prelude()(proj, *params, *const))
    v = proj[..., cfg.d_inner:2 * cfg.d_inner].unflatten(-1, (m.heads, m.headdim))
    yield ("mamba v, z copies (eager only)", 4 * MAMBA_LAYERS, lambda: v.contiguous(), None)
    # in_proj and the copies of z and x the kernels read: one GEMM then two copies (today), against three GEMMs on
    # row slices of the weight (mamba_split_in_proj), forward + backward
    sizes = [cfg.d_inner, cfg.d_inner, sum(m.split_sizes) - 2 * cfg.d_inner]

    def one_gemm(x, w):
        z, xs, rest = F.linear(x, w).split(sizes, dim=-1)
        return z.contiguous(), xs.contiguous(), rest

    def three_gemms(x, w):
        return tuple(F.linear(x, part) for part in w.split(sizes, dim=0))

    x = torch.randn(B, L, cfg.hidden, device=dev, dtype=torch.bfloat16)
    w = m.in_proj.weight.detach()
    dys = [torch.randn(B, L, n, device=dev, dtype=torch.bfloat16) for n in sizes]
    yield ("mamba in_proj + z, x copies fwd+bwd: split in_proj", MAMBA_LAYERS, fwd_bwd(one_gemm, [x, w], dys),
           fwd_bwd(three_gemms, [x, w], dys))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/glue.py times the regions on a GPU; no CUDA device here", file=sys.stderr)
        return 3
    dev = "cuda"
    torch.manual_seed(0)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, b {B} x {L} tokens, NAM56R widths\n")
    print("| region | calls/step | eager ms | compiled ms | eager/compiled | saved ms/step | max rel err |")
    print("|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for make in (moe_rows, mimo_rows, mamba_rows):
        for name, calls, eager, compiled in make(dev):
            ms_e = median_ms(eager, warmup=args.warmup, iters=args.iters)
            row = {"region": name, "calls_per_step": calls, "eager_ms": ms_e}
            if compiled is not None:
                ms_c = median_ms(compiled, warmup=args.warmup, iters=args.iters)  # warm-up compiles
                err = max(max_rel_error(c, e) for c, e in zip(_flat(compiled()), _flat(eager())))
                row.update(compiled_ms=ms_c, ratio=ms_e / ms_c, saved_ms_per_step=(ms_e - ms_c) * calls,
                           max_rel_err=err)
                print(f"| {name} | {calls} | {ms_e:.3f} | {ms_c:.3f} | {ms_e / ms_c:.2f}x | "
                      f"{(ms_e - ms_c) * calls:+.1f} | {err:.1e} |", flush=True)
            else:
                print(f"| {name} | {calls} | {ms_e:.3f} | - | - | {ms_e * calls:.1f} spent | - |", flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)
    return 0


def _flat(out) -> list[torch.Tensor]:
    """The tensors of a region's result (a tensor, or a tuple of them)."""
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


if __name__ == "__main__":
    sys.exit(main())
