"""Entry point of the sparse-mla plugin: what it declares (it implements no hook; the host does the rest).

Requesting the plugin selects ``attention_backend=sparse-mla`` and ``indexer_kernels_backend=sparse-mla`` (an
explicit ``--set`` wins): DSA layers then run their top-k attention on the plugin's Triton kernels and MLA layers (and DSA's
dense warm-up) on torch's fused SDPA; every DSA layer's lightning-indexer scores (with backward) and sparse KL
teacher run on the plugin's indexer kernels too. The kernels need a Hopper-or-newer GPU and Triton;
activation checks both, the model's head and index-head widths of the kinds the run uses (``PLUGIN.checks``)
and, on a real GPU, one tiny compile-and-launch parity run of every kernel against the reference
(``selftest.launch``). There is
no CPU fallback: on a CPU the ``reference`` backend is the implementation, by name.

This module stays light (no torch, no triton at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import PluginInfo, Requirement
from nam_core.checks import LaunchCheck, ShapeCheck
from nam_plugin_sparse_mla.shape import index_shape_problem, shape_problem

NAME = "sparse-mla"
GPU_HINT = "pip install 'nam-plugin-sparse-mla[gpu]'"

NAM56R_WIDTHS = {"h": 32, "dk": 128, "dv": 64, "index_heads": 32, "index_dim": 64}
"""Preflight's shape without a config: 32 heads over a 64 + 64 latent key, value 64; 32 index heads of 64
(nam56r.config)."""


def widths(model) -> dict[str, int]:
    return {"h": model.attn_heads, "dk": model.kv_lora_rank + model.qk_rope_dim, "dv": model.kv_lora_rank,
            "index_heads": model.index_heads, "index_dim": model.index_head_dim}


def attention_shapes(spec) -> tuple[bool, str]:
    model, w = spec.model, widths(spec.model)
    found = (f"dk {w['dk']} (kv_lora_rank {model.kv_lora_rank} + qk_rope_dim {model.qk_rope_dim}), "
             f"dv {w['dv']}, {w['h']} heads, top-k {model.index_topk}")
    problem = shape_problem(w["dk"], w["dv"], w["h"])
    return problem is None, f"{found}: {problem}" if problem else found


def index_shapes(spec) -> tuple[bool, str]:
    model = spec.model
    found = f"index_head_dim {model.index_head_dim}, {model.index_heads} index heads"
    problem = index_shape_problem(model.index_head_dim)
    return problem is None, f"{found}: {problem}" if problem else found


PLUGIN = PluginInfo(
    summary="sparse-mla: DSA top-k attention in MLA's absorbed form, the indexer's scores and its sparse KL "
            "teacher as Triton kernels (fp32 softmax and gradients), dense MLA on torch's fused SDPA",
    provides={"attention": {NAME: "nam_plugin_sparse_mla.attention:SparseMLA"},
              "indexer_kernels": {NAME: "nam_plugin_sparse_mla.attention:SparseMLAIndexerKernels"}},
    requires=(
        Requirement.cuda_capability((9, 0), reason="the kernels are built and tuned for Hopper (sm_90) and newer"),
        Requirement.package("triton>=3.3", install_hint=GPU_HINT),
    ),
    selects={"attention_backend": NAME, "indexer_kernels_backend": NAME},
    train_dtypes=("bfloat16", "float16"),  # the kernels refuse other operands (kernel.check_inputs)
    checks=(
        ShapeCheck("kernel shapes", "dk, dv powers of two in [16, 256], dv <= dk, 1..128 heads", attention_shapes,
                   "--set kv_lora_rank=64 --set qk_rope_dim=64 (NAM56R's widths), or run the pure-PyTorch core: "
                   "--set attention_backend=reference", when=lambda spec: spec.runs("attention", NAME)),
        ShapeCheck("indexer kernel shapes", "index_head_dim a power of two in [16, 256] (any number of index heads)",
                   index_shapes, "--set index_head_dim=64 (NAM56R's), or run the pure-PyTorch core: "
                   "--set attention_backend=reference", when=lambda spec: spec.runs("indexer_kernels", NAME)),
        LaunchCheck("kernel launch", None, "nam_plugin_sparse_mla.selftest:launch",
                    "report it with the seeds; meanwhile --set attention_backend=reference"),
    ),
)
