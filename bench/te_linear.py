"""One large linear, forward + backward, in torch bf16 and in Transformer Engine (bf16, FP8 current and delayed
scaling, and blockwise where this GPU runs it): the GEMM-level ceiling of what nam-plugin-te can gain.

    python bench/te_linear.py [--tokens 16384 --d-in 4096 --d-out 16384] [--json results/te_linear.json]

Each row: the median CUDA-event milliseconds of ``y = lin(x); y.backward(dy)`` (bf16 operands, weight gradient
included) and its speed-up over torch bf16. The TE rows use the plugin's own swap (``te_linear_from``), so
they time exactly what a run's projections run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402


def row(name: str, lin: nn.Module, x: torch.Tensor, dy: torch.Tensor, warmup: int, iters: int) -> dict:
    def step():
        lin.weight.grad = x.grad = None
        y = lin(x)
        y.backward(dy)

    return {"row": name, "ms": median_ms(step, warmup=warmup, iters=iters)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d-in", type=int, default=4096)
    p.add_argument("--d-out", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    from nam_plugin_te.linears import te_linear_from  # first: points TE at torch's cuDNN (nam_core.cudnn)

    import transformer_engine.pytorch as te
    from nam_plugin_te.recipes import te_recipe
    from nam_plugin_te.selftest import _support

    dev = "cuda"
    x = torch.randn(a.tokens, a.d_in, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(a.tokens, a.d_out, device=dev, dtype=torch.bfloat16)

    def fresh():
        lin = nn.Linear(a.d_in, a.d_out, bias=False, device=dev, dtype=torch.bfloat16)
        nn.init.normal_(lin.weight, std=a.d_in**-0.5)
        return lin

    rows = [row("torch bf16", fresh(), x, dy, a.warmup, a.iters),
            row("te bf16", te_linear_from(fresh(), te), x, dy, a.warmup, a.iters)]
    for name in ("current", "delayed", "blockwise"):
        ok, why = _support(te, name)
        if ok:
            rows.append(row(f"te fp8 {name}", te_linear_from(fresh(), te, te_recipe(name)), x, dy, a.warmup, a.iters))
        else:
            rows.append({"row": f"te fp8 {name}", "ms": None, "refused": why})
    base = rows[0]["ms"]
    print(f"{a.tokens}x{a.d_in} -> {a.d_out}, forward + backward, {torch.cuda.get_device_name()}, "
          f"TE {importlib.metadata.version('transformer-engine')}, torch {torch.__version__}")
    for r in rows:
        r["speedup"] = round(base / r["ms"], 3) if r["ms"] else None
        print(f"  {r['row']:<18} " + (f"{r['ms']:8.2f} ms  {r['speedup']:.2f}x" if r["ms"] else r.get("refused", "")))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"shape": [a.tokens, a.d_in, a.d_out], "gpu": torch.cuda.get_device_name(),
                                      "torch": torch.__version__,
                                      "te": importlib.metadata.version("transformer-engine"), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
