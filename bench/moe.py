"""Benchmark: NAM56R's routed experts, forward + backward, four ways on one GPU, as one table with ratios.

Rows (each includes routing's permutation, the gates and the sum back into tokens; router and shared expert
excluded, as they are the same for all):

* ``dense``: the reference (nam56r/reference/moe.py): every expert on every token, then the gate matrix.
* ``loop``: the upstream baseline, Megatron's ``SequentialMLP`` shape: rows sorted by expert, the per-expert
  counts read on the host (one sync), then one GEMM pair per expert.
* ``grouped``: grouped-moe (two ``grouped_mm`` launches per direction, counts on the device).
* ``grouped fp8``: the float8 plugin's routed experts (torchao's scaled grouped GEMM, rowwise scales); the
  bench needs nam-plugin-float8 and torchao installed, as every row runs or none does.

Inputs are NAM56R's expert shapes (hidden 4096, 16 experts of SwiGLU width 160, top-4) with routing from
random logits (``nam56r.testing.random_expert_inputs``). Each row also reports its output error against the
fp32 reference and its peak memory above the inputs::

    python bench/moe.py --json bench/results/moe.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from timing import time_and_peak

from nam56r.blocks.mlp import swiglu
from nam56r.experts import routed
from nam56r.testing import EXPERT_GRADS, random_expert_inputs


class LoopExperts:
    """One GEMM pair per expert over its rows, split by host counts: Megatron's ``SequentialMLP``."""

    def layer_state(self, cfg):
        return None

    def sorted(self, x, counts, probs, w_gate_up, w_down, state=None):
        sizes = counts.tolist()  # the host sync
        return torch.cat([(swiglu(xe @ w_gate_up[e].T) * pe.unsqueeze(-1).to(x.dtype)) @ w_down[e].T
                          for e, (xe, pe) in enumerate(zip(x.split(sizes), probs.split(sizes)))])

    def __call__(self, x, chosen, gates, w_gate_up, w_down, state=None):
        return routed(self.sorted, x, chosen, gates, w_gate_up, w_down, state)


def backends() -> dict:
    """Row name -> experts object."""
    from nam56r.reference.moe import ReferenceExperts
    from nam_plugin_grouped_moe.experts import GroupedExperts

    from nam_plugin_float8.experts import Float8GroupedExperts  # every row runs, or the bench does not

    return {"dense": ReferenceExperts(), "loop": LoopExperts(), "grouped": GroupedExperts(),
            "grouped fp8": Float8GroupedExperts()}


def measure(experts, inp: dict, *, warmup: int, iters: int, profile: str | None = None,
            profile_title: str = "") -> dict:
    from nam56r.reference.moe import ReferenceExperts
    from nam_core.testing import rel_norm_error

    leaves = {n: inp[n].clone().requires_grad_() for n in EXPERT_GRADS}
    state = experts.layer_state(None)
    if state is not None:
        state.cuda()

    def step():
        y = experts(leaves["x"], inp["chosen"], leaves["gates"], leaves["w_gate_up"], leaves["w_down"], state)
        y.backward(inp["dy"])

    def clear():
        for t in leaves.values():
            t.grad = None

    ms, peak = time_and_peak(step, clear, warmup=warmup, iters=iters)
    if profile is not None:  # one more step, outside the median: where the time goes, by kernel
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        with open(profile, "a") as f:
            f.write(f"\n{profile_title}\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15))
    with torch.no_grad():
        y = experts(*(inp[n] for n in ("x", "chosen", "gates", "w_gate_up", "w_down")), state)
        ref = ReferenceExperts()(inp["x"].float(), inp["chosen"], inp["gates"].float(), inp["w_gate_up"].float(),
                                 inp["w_down"].float())
    return {"ms": ms, "peak_extra_gib": peak, "out_err": rel_norm_error(y, ref)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="4096,8192,16384", help="comma-separated token counts")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=160)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--profile", default=None, help="file: append each row's kernel table (one extra step)")
    args = ap.parse_args(argv)

    paths = backends()
    results = []
    for t in (int(x) for x in args.tokens.split(",")):
        inp = random_expert_inputs(t, args.hidden, args.experts, args.topk, args.ffn, device="cuda", seed=args.seed)
        row = {"tokens": t}
        for name, experts in paths.items():
            row[name] = measure(experts, inp, warmup=args.warmup, iters=args.iters, profile=args.profile,
                                profile_title=f"{name}, {t} tokens")
        results.append(row)
        del inp
        torch.cuda.empty_cache()

    names = list(paths)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.experts} experts of SwiGLU width "
          f"{args.ffn} on hidden {args.hidden}, top-{args.topk}, routing from random logits, bf16; forward + "
          f"backward incl. permutation and the weighted sum back; median of {args.iters}\n")
    print("| tokens | " + " | ".join(f"{n} ms" for n in names) + " | grouped vs loop | grouped vs dense | "
          "fp8 vs grouped | out err (dense, loop, grouped, fp8) |")
    print("|---" * (len(names) + 5) + "|")
    for row in results:
        ms = {n: row[n]["ms"] for n in names}
        cells = [f"{ms[n]:.2f}" for n in names]

        def ratio(a, b):
            return f"{ms[b] / ms[a]:.2f}x"

        errs = ", ".join(f"{row[n]['out_err']:.1e}" for n in names)
        print(f"| {row['tokens']} | " + " | ".join(cells) + f" | {ratio('grouped', 'loop')} | "
              f"{ratio('grouped', 'dense')} | {ratio('grouped fp8', 'grouped')} | {errs} |")
    if args.json_path:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": vars(args)}
        with open(args.json_path, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
