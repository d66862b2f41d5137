"""Entry point of the mimo-scan plugin: what it declares (it implements no hook; the host does the rest).

Requesting the plugin selects ``ssm_backend=mimo-scan`` (an explicit ``--set ssm_backend=...`` wins): the
Mamba-3 MIMO layers then run their scan, forward and backward, on nam's own Triton kernels (scan.py,
kernels.py). Activation checks the GPU, the shared memory the largest kernel asks, Triton, and, when the run
uses the scan, CUDA, bf16 and the MIMO widths the kernels take (``PLUGIN.checks``); on a real GPU preflight
launches every kernel once against the reference (``selftest.launch``). There is no CPU fallback: on a CPU the
``reference`` backend is the implementation, by name.

This module stays light (no torch, no triton at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import PluginInfo, Requirement
from nam_core.checks import LaunchCheck, ShapeCheck

NAME = "mimo-scan"
GPU_HINT = "pip install 'nam-plugin-mimo-scan[gpu]'"
REFERENCE_HINT = "or the pure-PyTorch scan: --set ssm_backend=reference --plugins reference"

SMEM_BYTES = 65_536
"""Shared memory per block a device must offer so that every kernel has a launch config that fits: the largest,
over the kernels, of the smallest config's need at NAM56R's widths (d_state 128, headdim 64, rank 4, 16-token
tiles). It is the per-head backward pass at 16 warps (at 4 warps with 2 stages, its faster config: 75,264 B);
the walks' 1-stage configs take 16,384 B, dq 32,768 B, the rest <= 24,576 B. From Triton 3.6's sm_90 build
(``gpu/mimo_compile.py``, 2026-11-29, again after r47, whose per-head pass loads each token's row once: 73,728 ->
65,536 B at 16 warps; the GPU's ``.metadata.shared`` per launch lands in ``scan.SHARED_BYTES``).
Configs that need more (the walks' 2-stage configs ~107-123 KB since r52's per-row table read, dq / dk with 2
stages ~70-143 KB) are timed where they fit and skipped by the autotuner where they do not. Under sm_121's
(GB10) 101,376 B, so the declared requirements pass a ``--device-profile gb10`` preflight; the sm_121 build
itself is not measured."""



def shape_problem(model) -> str | None:
    """Why the kernels cannot run this model's Mamba-3 widths, or None."""
    n, p, r = model.d_state, model.mamba_headdim, model.mamba_mimo_rank
    if r < 2:
        return "rank 1 (SISO): this backend runs MIMO only (rank >= 2)"
    if n < 32 or n & (n - 1) or n > 256:
        return f"d_state {n} is not a power of two in [32, 256] (two halves of >= 16 for tl.dot)"
    if p < 16 or p & (p - 1) or p > 128:
        return f"headdim {p} is not a power of two in [16, 128]"
    if r > 16:
        return f"rank {r} > 16 (a tile holds 128 (token, rank) rows, at least 8 tokens)"
    if model.mamba_rope_fraction not in (0.5, 1.0):
        return f"rope fraction {model.mamba_rope_fraction} (the kernels rotate half or all of the state dims)"
    return None


def kernel_shapes(spec) -> tuple[bool, str]:
    model = spec.model
    widths = (f"d_state {model.d_state}, headdim {model.mamba_headdim}, rank {model.mamba_mimo_rank}, "
              f"ngroups {model.mamba_ngroups}")
    problem = shape_problem(model)
    return problem is None, f"{widths}: {problem}" if problem else widths


def index_range(spec) -> tuple[bool, str]:
    """Whether every buffer of the scan at the run's micro-batch and sequence stays within 32-bit offsets."""
    from nam_plugin_mimo_scan.scan import index_problem

    model, b = spec.model, spec.train.micro_batch_size
    found = f"micro-batch {b} x {model.seq_len} tokens"
    problem = index_problem(b, model.seq_len, model.mamba_heads, model.mamba_mimo_rank, model.d_state,
                            model.mamba_headdim, int(model.d_state * model.mamba_rope_fraction) // 2)
    return problem is None, f"{found}: {problem}" if problem else found


def shapes_hint(spec) -> str:
    if spec.model.mamba_mimo_rank < 2:
        return "--set ssm_backend=reference --plugins reference, or --set ssm_backend=mamba-ssm --plugins mamba-ssm"
    return f"NAM56R's widths (d_state 128, headdim 64, rank 4), {REFERENCE_HINT}"


PLUGIN = PluginInfo(
    summary="mimo-scan: nam's own chunk-parallel Mamba-3 MIMO scan (forward and backward, every input "
            "gradient) as Triton kernels; deterministic, no host syncs; CUDA",
    provides={"ssm": {NAME: "nam_plugin_mimo_scan.scan:MimoScan"}},
    requires=(
        Requirement.cuda_capability((9, 0), reason="the kernels are written and measured for Hopper (sm_90) and "
                                                   "newer"),
        Requirement.shared_memory_per_block(SMEM_BYTES, reason="the largest kernel's shared memory at NAM56R's "
                                                               "widths"),
        Requirement.package("triton>=3.5", install_hint=GPU_HINT),
    ),
    selects={"ssm_backend": NAME},
    train_device="cuda", train_dtypes=("bfloat16",),
    train_needs_reason="the kernels run CUDA tensors and are held to parity in bf16",
    checks=(
        ShapeCheck("kernel shapes", "MIMO (rank 2..16), d_state a power of two in [32, 256], headdim a power of two "
                   "in [16, 128]", kernel_shapes, shapes_hint),
        ShapeCheck("index range", "every buffer of the scan under 2**31 elements (the kernels' offsets are 32-bit)",
                   index_range, "a smaller train.micro_batch_size (the row names the largest that fits)"),
        LaunchCheck("kernel launch", "kernel == reference within 2e-2 (output and every input gradient, bf16, 4 heads "
                    "in 2 groups)", "nam_plugin_mimo_scan.selftest:launch",
                    f"report it with the seed; meanwhile {REFERENCE_HINT}"),
    ),
)
