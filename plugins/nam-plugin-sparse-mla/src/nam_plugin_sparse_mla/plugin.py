"""Entry point of the sparse-mla plugin: what it declares and the hooks it implements.

Requesting the plugin selects ``attention_backend=sparse-mla`` and ``indexer_kernels_backend=sparse-mla`` (an
explicit ``--set`` wins): DSA layers then run their top-k attention on the plugin's Triton kernels and MLA layers (and DSA's
dense warm-up) on torch's fused SDPA; every DSA layer's lightning-indexer scores (with backward) and sparse KL
teacher run on the plugin's indexer kernels too. The kernels need a Hopper-or-newer GPU and Triton;
activation checks both, the model's head and index-head widths (``nam_check_config``) and, on a real GPU,
one tiny compile-and-launch parity run of every kernel against the reference (``nam_preflight``). There is
no CPU fallback: on a CPU the ``reference`` backend is the implementation, by name.

This module stays light (no torch, no triton at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.requirements import FAIL, PASS

NAME = "sparse-mla"
GPU_HINT = "pip install 'nam-plugin-sparse-mla[gpu]'"

PLUGIN = PluginInfo(
    summary="sparse-mla: DSA top-k attention in MLA's absorbed form, the indexer's scores and its sparse KL "
            "teacher as Triton kernels (fp32 softmax and gradients), dense MLA on torch's fused SDPA",
    provides={"attention": [NAME], "indexer_kernels": [NAME]},
    requires=(
        Requirement.cuda_capability((9, 0), reason="the kernels are built and tuned for Hopper (sm_90) and newer"),
        Requirement.package("triton>=3.3", install_hint=GPU_HINT),
    ),
    selects={"attention_backend": NAME, "indexer_kernels_backend": NAME},
)

NAM56R_WIDTHS = {"h": 32, "dk": 128, "dv": 64, "index_heads": 32, "index_dim": 64}
"""Preflight's shape without a config: 32 heads over a 64 + 64 latent key, value 64; 32 index heads of 64
(nam56r.config)."""


def _widths(model) -> dict[str, int]:
    return {"h": model.attn_heads, "dk": model.kv_lora_rank + model.qk_rope_dim, "dv": model.kv_lora_rank,
            "index_heads": model.index_heads, "index_dim": model.index_head_dim}


@hookimpl
def nam_check_config(config, device):
    from nam_plugin_sparse_mla.shape import index_shape_problem, shape_problem

    model = config.model
    w = _widths(model)
    found = (f"dk {w['dk']} (kv_lora_rank {model.kv_lora_rank} + qk_rope_dim {model.qk_rope_dim}), "
             f"dv {w['dv']}, {w['h']} heads, top-k {model.index_topk}")
    problem = shape_problem(w["dk"], w["dv"], w["h"])
    checks = [Check(NAME, "kernel shapes", FAIL if problem else PASS,
                    "dk, dv powers of two in [16, 256], dv <= dk, 1..128 heads",
                    f"{found}: {problem}" if problem else found,
                    hint=None if problem is None else
                    "--set kv_lora_rank=64 --set qk_rope_dim=64 (NAM56R's widths), or run the pure-PyTorch "
                    "core: --set attention_backend=reference")]
    index_problem = index_shape_problem(model.index_head_dim)
    index_found = f"index_head_dim {model.index_head_dim}, {model.index_heads} index heads"
    checks.append(Check(NAME, "indexer kernel shapes", FAIL if index_problem else PASS,
                        "index_head_dim a power of two in [16, 256] (any number of index heads)",
                        f"{index_found}: {index_problem}" if index_problem else index_found,
                        hint=None if index_problem is None else
                        "--set index_head_dim=64 (NAM56R's), or run the pure-PyTorch core: "
                        "--set attention_backend=reference"))
    return checks


@hookimpl
def nam_preflight(device, config):
    """On a real CUDA device: compile and launch the kernels once, forward and backward, against the reference."""
    from nam_plugin_sparse_mla.shape import index_shape_problem, shape_problem

    w = _widths(config.model) if config is not None else dict(NAM56R_WIDTHS)
    if shape_problem(w["dk"], w["dv"], w["h"]) is not None or index_shape_problem(w["index_dim"]) is not None:
        return []  # already a failed config check
    from nam_plugin_sparse_mla.selftest import parity

    needed = ("kernel == reference within {tol:g} (out, dq, dkv; sparse and dense; index-score dq, dk; "
              "fp32 index scores, dw and sparse teacher within 1e-4)")
    err, tol, details = parity(h=w["h"], dk=w["dk"], dv=w["dv"], index_heads=w["index_heads"],
                               index_dim=w["index_dim"], device="cuda")
    ok = err <= tol
    seeds = "seeds " + ", ".join(str(details[k]["seed"]) for k in ("sparse", "dense", "index_scores", "teacher"))
    return [Check(NAME, "kernel launch", PASS if ok else FAIL, needed.format(tol=tol),
                  f"worst relative error {err:.2e} (b=2 s=160 h={w['h']} dk={w['dk']} dv={w['dv']} top-k 96, "
                  f"{w['index_heads']} index heads of {w['index_dim']}, bf16; {seeds})",
                  hint=None if ok else "report it with the seeds; meanwhile "
                                       "--set attention_backend=reference")]


@hookimpl
def nam_register_attention_backends(register):
    from nam_plugin_sparse_mla.attention import SparseMLA

    register(NAME, SparseMLA)


@hookimpl
def nam_register_indexer_kernels_backends(register):
    from nam_plugin_sparse_mla.attention import SparseMLAIndexerKernels

    register(NAME, SparseMLAIndexerKernels)
