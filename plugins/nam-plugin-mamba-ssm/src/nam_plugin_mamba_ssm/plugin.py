"""Entry point of the mamba-ssm plugin: what it declares and the hook that registers its patches.

Requesting the plugin selects ``ssm_backend=mamba-ssm`` (an explicit ``--set ssm_backend=...`` wins). Order
within a run that uses the scan: activation checks the requirements below and the widths (``PLUGIN.checks``); on
a real GPU preflight compiles and launches the kernels once against the reference and builds them for the run's
sizes (``preflight.py``); the engine then
applies the patch lane (``patches.py``: import shim, grouped MIMO backward, MIMO host overhead) and builds the
scan, which refuses MIMO if a needed patch is missing.

This module stays light (no torch, no mamba-ssm at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import PluginInfo, Requirement, hookimpl
from nam_core.checks import LaunchCheck, ShapeCheck
from nam_core.options import Option

NAME = "mamba-ssm"
GPU_HINT = "MAMBA_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation 'nam-plugin-mamba-ssm[gpu]'"
REFERENCE_HINT = "or the pure-PyTorch scan: --set ssm_backend=reference --plugins reference"

MIMO_SMEM_BYTES = 223_904
"""Dynamic shared memory per block of the largest MIMO kernel (the backward's second pass) at NAM56R's widths
(d_state 128, headdim 64, rank 4, chunk 16), read from the launch in TileLang 0.1.8's generated host code on
the H100 host (the forward asks 84,096 B, the backward's first pass 90,240 B). An H100 or H200 offers 232,448 B;
sm_121's 101,376 B cannot hold it."""


MIMO_HEAD_DIMS = {"n": (16, 32, 64, 128, 256), "p": (32, 64, 128), "r": (2, 4, 8)}
"""State size n, head size p and rank r the MIMO kernels are tested with upstream; others may not compile."""


def shape_problem(model) -> str | None:
    """Why the kernels cannot run this model's Mamba-3 widths, or None."""
    n, p, r, chunk = model.d_state, model.mamba_headdim, model.mamba_mimo_rank, model.mamba_chunk
    if model.mamba_rope_fraction not in (0.5, 1.0):
        return f"rope fraction {model.mamba_rope_fraction} (the kernels rotate half or all of the state dims)"
    if r == 1:
        for what, value in (("d_state", n), ("headdim", p)):
            if value < 16 or value & (value - 1):
                return f"SISO {what} {value} is not a power of two >= 16 (TMA tiles)"
        return None
    for key, value in (("n", n), ("p", p), ("r", r)):
        if value not in MIMO_HEAD_DIMS[key]:
            return f"MIMO {dict(n='d_state', p='headdim', r='rank')[key]} {value} is not one of {MIMO_HEAD_DIMS[key]}"
    if chunk < 8 or chunk * r > 64:
        return f"MIMO chunk {chunk} x rank {r}: the kernels need chunk >= 8 and chunk x rank <= 64 (shared memory)"
    return None


def kernel_shapes(spec) -> tuple[bool, str]:
    model = spec.model
    widths = (f"d_state {model.d_state}, headdim {model.mamba_headdim}, rank {model.mamba_mimo_rank}, "
              f"chunk {model.mamba_chunk}, ngroups {model.mamba_ngroups}")
    problem = shape_problem(model)
    return problem is None, f"{widths}: {problem}" if problem else widths


PLUGIN = PluginInfo(
    summary="mamba-ssm: Mamba-3 scan on mamba-ssm's kernels (SISO Triton, MIMO TileLang) with a grouped MIMO "
            "backward and kernels compiled once; CUDA",
    provides={"ssm": {NAME: "nam_plugin_mamba_ssm.scan:MambaSSMScan"},
              "patches": ["mamba-ssm-import-shim", "mamba-ssm-package-import", "mamba3-mimo-grouped-bwd", "mamba3-mimo-host-overhead",
                          "mamba3-mimo-static-shapes", "mamba3-mimo-saved-tensors-once"]},
    requires=(
        # The SISO kernels build TMA descriptors (sm_90); the MIMO kernels are written and tuned for the H100.
        Requirement.cuda_capability((9, 0), reason="mamba-ssm's Mamba-3 kernels use Hopper TMA and are tuned on H100"),
        Requirement.shared_memory_per_block(MIMO_SMEM_BYTES, reason="the largest MIMO kernel's dynamic shared "
                                            "memory at NAM56R's widths"),
        Requirement.package("mamba-ssm>=2.3.2", install_hint=GPU_HINT),
        Requirement.package("tilelang>=0.1.8", install_hint=GPU_HINT, known_bad={
            "0.1.15": "cannot build mamba-ssm 2.3.2.post1's MIMO forward kernel ('ReduceOp cannot lower a layout "
                      "where a source index depends on a thread-owned reduce segment', H100, 2026-11-23); "
                      "mamba-ssm pins 0.1.8"}),
        Requirement.package("triton>=3.5", install_hint=GPU_HINT),
    ),
    selects={"ssm_backend": NAME},
    options=(Option("group_sums", str, None, "how the MIMO backward sums dQ and dK per group and per head "
                    "(mimo.reduce_groups): eager (two torch reductions), compiled (one torch.compile region) or fused "
                    "(one Triton kernel that reads the gradient once: group_sums.py; unset: this). Measured on an "
                    "H200 at MBS 4: fused 1.31x and compiled 0.50x of eager (bench/group_sums.py, bench/glue.py)",
                    choices=("eager", "compiled", "fused")),),
    train_device="cuda", train_dtypes=("bfloat16",),
    train_needs_reason="the kernels run CUDA tensors only; SISO casts to bf16 whatever it is given, MIMO is "
                       "measured in bf16",
    checks=(
        ShapeCheck("kernel shapes", "widths mamba-ssm's Mamba-3 kernels compile for", kernel_shapes,
                   f"NAM56R's widths (d_state 128, headdim 64, rank 4, chunk 16), {REFERENCE_HINT}"),
        LaunchCheck("kernel launch", None, "nam_plugin_mamba_ssm.preflight:launch",
                    f"report it with the seed; meanwhile {REFERENCE_HINT}"),
        LaunchCheck("kernel build", None, "nam_plugin_mamba_ssm.preflight:build",
                    f"report it; meanwhile {REFERENCE_HINT}"),
    ),
)


@hookimpl
def nam_register_patches(register):
    from nam_plugin_mamba_ssm.patches import make_patches

    for name, patch in make_patches().items():
        register(name, patch)
