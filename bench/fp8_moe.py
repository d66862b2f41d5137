"""Benchmark: NAM56R's routed experts with FP8 expert GEMMs (fp8-moe) against bf16, on one GPU.

Shape: one MoE layer's routed experts at NAM56R's widths: 16 experts of SwiGLU width 160 on hidden 4096, top-4,
32768 tokens (a micro-batch of 8 x 4096, the published MBS), routing from random logits (about 8192 rows
per expert; ``--balanced``: exactly 8192), bf16 tokens and weights. Two scopes, one table:

* ``block``: forward + backward of the routed experts (dispatch, casts, GEMMs, SwiGLU, combine). Rows:
  ``fp8`` (the plugin), ``bf16 grouped`` (the same dispatch with bf16 ``torch.mm``: the ratios' baseline),
  ``reference`` (nam's dense experts, 4x the FLOPs). ``err`` is the output's relative L2 error against the
  fp32 reference on the same inputs.
* ``gemms``: only the four expert GEMMs that fp8-moe runs in FP8 (gate/up and down forward, both input
  gradients), operands prepared beforehand. Rows: ``fp8 _scaled_mm`` (per expert, per-tensor scales, fast
  accumulation on the two gradient GEMMs, each GEMM over all experts before the next: as the plugin calls
  it), ``bf16 mm`` (per expert), and ``bf16 _grouped_mm`` (torch's grouped GEMM, one launch per
  GEMM: the ratios' baseline).

Timing: CUDA events, median of --iters after --warmup (bench/timing.py). Prints one table; --json writes it.

    python bench/fp8_moe.py --json bench/results/fp8_moe.json
    python bench/fp8_moe.py --balanced --json bench/results/fp8_moe_balanced.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from timing import median_ms, time_and_peak


def expert_inputs(t, d, e, k, f, *, balanced: bool, seed=0):
    from nam_plugin_fp8_moe.selftest import random_inputs

    inp = random_inputs(t, d, e, k, f, device="cuda", seed=seed)
    if balanced:  # token i takes experts (i*k .. i*k + k-1) mod E: every expert gets exactly t*k/E rows
        slots = torch.arange(t * k, device="cuda").view(t, k)
        inp["chosen"] = slots % e
    return inp


def block_rows(inp, warmup, iters) -> dict:
    from nam56r.reference.moe import ReferenceExperts
    from nam_core.testing import rel_norm_error
    from nam_plugin_fp8_moe.experts import FP8Experts
    from nam_plugin_fp8_moe.kernel import triton_cast

    leaves = {n: inp[n].clone().requires_grad_() for n in ("x", "gates", "w_gate_up", "w_down")}
    with torch.no_grad():
        ref = ReferenceExperts()(inp["x"].float(), inp["chosen"], inp["gates"].float(),
                                 inp["w_gate_up"].float(), inp["w_down"].float())
    rows = {}
    for name, backend in [("fp8", FP8Experts(cast=triton_cast)), ("bf16 grouped", FP8Experts(precision="bf16")),
                          ("reference", ReferenceExperts())]:
        state = backend.layer_state(None)
        if state is not None:
            state.cuda()

        def step():
            y = backend(leaves["x"], inp["chosen"], leaves["gates"], leaves["w_gate_up"], leaves["w_down"], state)
            y.backward(inp["dy"])
            return y

        def clear():
            for p in leaves.values():
                p.grad = None

        ms, peak = time_and_peak(step, clear, warmup=warmup, iters=iters)
        with torch.no_grad():
            y = backend(leaves["x"], inp["chosen"], leaves["gates"], leaves["w_gate_up"],
                        leaves["w_down"], state)
        rows[name] = {"scope": "block", "ms": ms, "peak_extra_gib": peak, "err": rel_norm_error(y, ref)}
        clear()
    return rows


def gemm_rows(inp, warmup, iters) -> dict:
    """The four FP8-able expert GEMMs, operands ready (as after dispatch and casts)."""
    from nam_plugin_fp8_moe.experts import _spans, dispatch
    from nam_plugin_fp8_moe.quant import E4M3, E5M2, weight_fp8

    x, w_gu, w_d = inp["x"], inp["w_gate_up"], inp["w_down"]
    e, two_f, d = w_gu.shape
    f = two_f // 2
    order, inverse, tok, counts = dispatch(inp["chosen"], e)
    rows_n = tok.numel()
    g = torch.Generator(device="cuda").manual_seed(1)
    xs, a = x[tok], torch.randn(rows_n, f, device="cuda", generator=g).bfloat16()
    do, dh = torch.randn(rows_n, d, device="cuda", generator=g).bfloat16(), torch.randn(
        rows_n, two_f, device="cuda", generator=g).bfloat16()
    one = torch.ones((), device="cuda")
    q = {"xs": xs.to(E4M3), "a": a.to(E4M3), "do": do.to(E5M2), "dh": dh.to(E5M2)}
    wq_gu, s_gu = weight_fp8(w_gu)
    wq_d, s_d = weight_fp8(w_d)
    wq_gu_t, wq_d_t = wq_gu.transpose(1, 2).contiguous(), wq_d.transpose(1, 2).contiguous()

    def col_major(w):  # the same [E, K, N] values, each expert's matrix stored column-major
        return w.transpose(1, 2).contiguous().transpose(1, 2)

    b_gu_fwd, b_d_fwd, b_d_bwd, b_gu_bwd = w_gu.transpose(1, 2), w_d.transpose(1, 2), col_major(w_d), col_major(w_gu)
    w_gu_t, w_d_t = w_gu.transpose(1, 2).contiguous(), w_d.transpose(1, 2).contiguous()
    out = {"h": torch.empty(rows_n, two_f, device="cuda", dtype=torch.bfloat16),
           "o": torch.empty(rows_n, d, device="cuda", dtype=torch.bfloat16),
           "da": torch.empty(rows_n, f, device="cuda", dtype=torch.bfloat16),
           "dx": torch.empty(rows_n, d, device="cuda", dtype=torch.bfloat16)}
    spans = list(_spans(counts))

    # Each GEMM over all experts, then the next GEMM: the order the plugin launches them in.
    def fp8():
        for src, w, sw, dst, fast in [("xs", wq_gu, s_gu, "h", False), ("a", wq_d, s_d, "o", False),
                                      ("do", wq_d_t, s_d, "da", True), ("dh", wq_gu_t, s_gu, "dx", True)]:
            for i, o, n in spans:
                torch._scaled_mm(q[src][o:o + n], w[i].t(), scale_a=one, scale_b=sw[i], out_dtype=torch.bfloat16,
                                 out=out[dst][o:o + n], use_fast_accum=fast)

    def bf16_mm():
        for src, w, dst in [(xs, w_gu, "h"), (a, w_d, "o"), (do, w_d_t, "da"), (dh, w_gu_t, "dx")]:
            for i, o, n in spans:
                torch.mm(src[o:o + n], w[i].t(), out=out[dst][o:o + n])

    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)

    def grouped():
        torch._grouped_mm(xs, b_gu_fwd, offs=offs)  # [E, d, 2f]: per expert K x N, column-major
        torch._grouped_mm(a, b_d_fwd, offs=offs)
        torch._grouped_mm(do, b_d_bwd, offs=offs)
        torch._grouped_mm(dh, b_gu_bwd, offs=offs)

    flop = 2 * rows_n * (d * two_f + f * d + d * f + two_f * d)
    rows = {}
    for name, fn in [("fp8 _scaled_mm", fp8), ("bf16 mm", bf16_mm), ("bf16 _grouped_mm", grouped)]:
        try:
            ms = median_ms(fn, warmup=warmup, iters=iters)
        except Exception as err:  # only a baseline row may record an error
            if name == "fp8 _scaled_mm":
                raise
            rows[name] = {"scope": "gemms", "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
            continue
        rows[name] = {"scope": "gemms", "ms": ms, "tflops": flop / ms / 1e9}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=160)
    ap.add_argument("--balanced", action="store_true", help="exactly t*k/E rows per expert instead of routing "
                    "from random logits")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)

    inp = expert_inputs(args.tokens, args.hidden, args.experts, args.topk, args.ffn, balanced=args.balanced)
    rows = block_rows(inp, args.warmup, args.iters) | gemm_rows(inp, args.warmup, args.iters)
    base = {"block": rows["bf16 grouped"], "gemms": rows["bf16 _grouped_mm"]}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens, {args.experts} experts "
          f"of {args.ffn} on hidden {args.hidden}, top-{args.topk}, "
          f"{'balanced' if args.balanced else 'random'} routing, bf16 inputs; median of {args.iters}\n")
    print("| scope | path | ms | speed-up vs baseline | TFLOP/s | peak extra GiB | out err vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {r['scope']} | {name} | {r['error']} | | | | |")
            continue
        b = base[r["scope"]]
        r["speedup_vs_baseline"] = b["ms"] / r["ms"] if "ms" in b else None
        ratio = f"{r['speedup_vs_baseline']:.2f}x" if r["speedup_vs_baseline"] else "-"
        print(f"| {r['scope']} | {name} | {r['ms']:.3f} | {ratio} | {r.get('tflops', float('nan')):.0f} | "
              f"{r.get('peak_extra_gib', float('nan')):.2f} | {r.get('err', float('nan')):.4f} |")
    if args.json_path:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": vars(args)}
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
