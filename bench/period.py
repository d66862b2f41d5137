"""Benchmark: one NAM56R pattern period (12 layers, full widths) on one GPU, training steps, by backend set.

The model is NAM56R with ``num_layers=12``: one period of ``*EME*EME*EMM*`` (4 Mamba-3, 5 MoE, 1 MLA, 2 DSA
layers) plus everything around the stack (n-gram-hash embedding, vocab 131072 embedding and head, both MTP
depths), hidden 4096, sequence 4096, bf16. A step is forward + backward of the whole loss (no optimizer).

Rows:

* ``nam``         the fast plugins: mamba-ssm (patch lane applied, compiled prelude), sparse-mla, liger; ngroups 8;
* ``reference``   the same model on nam's pure-PyTorch backends on the GPU; ngroups 8;
* ``upstream``    Mamba-3 through mamba-ssm's ``mamba3_mimo`` as released (only the import shim), CE through
                  Liger as released, attention on nam's reference (no upstream kernel takes NAM56R's 128/64
                  latent widths); measured first, at ngroups 8 (its backward raises: reported) and at ngroups 1,
                  the setting it runs.

Tokens/s = batch x seq / median step time (CUDA events); model TFLOP/s = ``nam56r.flops.flops_per_token`` x
tokens/s. Prints one markdown table with ratios to each baseline and writes ``--json``.

    python bench/period.py --json bench/results/period.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import traceback
from pathlib import Path

import torch
from timing import time_and_peak


class UpstreamMimo:
    """``SSMScan`` straight onto mamba-ssm's ``mamba3_mimo`` with none of nam's patches (the baseline)."""

    def __call__(self, q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, *, chunk_size):
        from nam_plugin_mamba_ssm import upstream
        from nam_plugin_mamba_ssm.scan import mimo_args

        fn = upstream.load(upstream.MIMO_MODULE).mamba3_mimo
        return fn(*mimo_args(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o,
                             chunk_size=chunk_size))


def config(groups: int, **backends):
    from nam56r.config import NAM56RConfig

    # Attention slot 0 is MLA as in the full model (ranks 0, 4, 8, 12 of 13); slots 1 and 2 are DSA.
    return NAM56RConfig(num_layers=12, mla_attention_ranks=(0,), mamba_ngroups=groups, indexer_backend="full",
                        **backends)


def measure(cfg, backends, *, batch: int, warmup: int, iters: int, baseline: bool = False) -> dict:
    """One row. Only a ``baseline`` row may fail and report its exception as its result; a failure of nam's
    own row ends the run."""
    from nam56r.flops import flops_per_token
    from nam56r.model import build_model
    from nam56r.state import ForwardState

    torch.manual_seed(0)
    model = build_model(cfg, backends, device="cuda").to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g).cuda()
    targets, mask = tokens.roll(-1, 1), torch.ones(batch, cfg.seq_len, device="cuda")

    def clear():
        for p in model.parameters():
            p.grad = None

    def step():
        clear()
        model(tokens, targets, mask, state=ForwardState())["loss"].backward()

    try:
        ms, gib = time_and_peak(step, clear, warmup=warmup, iters=iters)
    except Exception as e:  # a baseline's failure is its result
        if not baseline:
            raise
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200],
                "where": traceback.extract_tb(e.__traceback__)[-1].name}
    finally:
        del model
        torch.cuda.empty_cache()
    tokens_per_s = batch * cfg.seq_len / (ms / 1e3)
    flops = flops_per_token(cfg).total
    return {"ms": ms, "peak_gib": gib, "tokens_per_s": tokens_per_s, "tflops": flops * tokens_per_s / 1e12,
            "flops_per_token": flops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma-separated rows to leave out: upstream, reference")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    from nam56r.model import Backends
    from nam_plugin_liger.head import LigerCEHead
    from nam_plugin_mamba_ssm import patches, upstream
    from nam_plugin_mamba_ssm.scan import MambaSSMScan
    from nam_plugin_sparse_mla.attention import SparseMLA, SparseMLAIndexerKernels

    upstream.install_shim()
    ref = Backends.reference()
    rows = {}
    if "upstream" not in skip:  # before the patch lane binds nam's drivers
        upstream_backends = dataclasses.replace(ref, ssm=UpstreamMimo(), ce=LigerCEHead())
        for groups in (8, 1):
            print(f"[upstream] ngroups {groups} ...", flush=True)
            rows[f"upstream g{groups}"] = measure(config(groups), upstream_backends, batch=args.batch, warmup=1,
                                                  iters=min(args.iters, 3), baseline=True)
    print(f"patch lane applied: {patches.apply_needed()}", flush=True)
    print("[nam] ...", flush=True)
    ours = Backends(ssm=MambaSSMScan(), attention=SparseMLA(), indexer_kernels=SparseMLAIndexerKernels(),
                    ce=LigerCEHead(), indexer=ref.indexer, moe=ref.moe)
    rows["nam"] = measure(config(8, ssm_backend="mamba-ssm", attention_backend="sparse-mla",
                                 indexer_kernels_backend="sparse-mla", ce_backend="liger", mamba_compile_prelude=True),
                          ours, batch=args.batch, warmup=args.warmup, iters=args.iters)
    if "reference" not in skip:
        print("[reference] ...", flush=True)
        rows["reference"] = measure(config(8), ref, batch=args.batch, warmup=1, iters=min(args.iters, 3),
                                    baseline=True)

    nam = rows["nam"]
    print(f"\nNAM56R one period (12 layers, full widths), b={args.batch} s=4096 bf16, fwd+bwd, "
          f"{torch.cuda.get_device_name()}\n")
    print("| row | step ms | tokens/s | model TFLOP/s | peak GiB | nam speed-up |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | raises {r['error'].split(':')[0]} in {r['where']} | - | - | - | - |")
            continue
        speed = f"{r['ms'] / nam['ms']:.2f}x" if "ms" in nam else "-"
        print(f"| {name} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {r['peak_gib']:.1f} "
              f"| {speed} |")

    if args.json:
        import importlib.metadata as md

        meta = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__, "batch": args.batch, "seq": 4096, "layers": 12,
                "versions": {d: md.version(d) for d in ("mamba-ssm", "tilelang", "triton", "liger-kernel")}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
