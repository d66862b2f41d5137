"""Entry point of the mamba-ssm plugin: what it declares and the hooks it implements.

Requesting the plugin selects ``ssm_backend=mamba-ssm`` (an explicit ``--set ssm_backend=...`` wins). Order
within a run: activation checks the requirements below and the config (``nam_check_config``); on a real GPU
preflight compiles and launches the kernels once against the reference (``nam_preflight``); the engine then
applies the patch lane (``patches.py``: import shim, grouped MIMO backward, MIMO host overhead) and builds the
scan, which refuses MIMO if a needed patch is missing.

This module stays light (no torch, no mamba-ssm at import) so ``nam plugins list`` can read ``PLUGIN``.
"""

from __future__ import annotations

from nam_core import Check, PluginInfo, Requirement, hookimpl
from nam_core.requirements import FAIL, PASS, SKIP

NAME = "mamba-ssm"
GPU_HINT = "MAMBA_SKIP_CUDA_BUILD=TRUE pip install --no-build-isolation 'nam-plugin-mamba-ssm[gpu]'"
REFERENCE_HINT = "or the pure-PyTorch scan: --set ssm_backend=reference --plugins reference"

MIMO_SMEM_BYTES = 223_904
"""Dynamic shared memory per block of the largest MIMO kernel (the backward's second pass) at NAM56R's widths
(d_state 128, headdim 64, rank 4, chunk 16), read from the launch in TileLang 0.1.8's generated host code on
the H100 host (the forward asks 84,096 B, the backward's first pass 90,240 B). An H100 or H200 offers 232,448 B;
sm_121's 101,376 B cannot hold it."""

PLUGIN = PluginInfo(
    summary="mamba-ssm: Mamba-3 scan on mamba-ssm's kernels (SISO Triton, MIMO TileLang) with a grouped MIMO "
            "backward and kernels compiled once; CUDA",
    provides={"ssm": [NAME], "patches": ["mamba-ssm-import-shim", "mamba3-mimo-grouped-bwd",
                                                "mamba3-mimo-host-overhead", "mamba3-mimo-static-shapes"]},
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
    train_device="cuda", train_dtypes=("bfloat16",),
    train_needs_reason="the kernels run CUDA tensors only; SISO casts to bf16 whatever it is given, MIMO is "
                       "measured in bf16",
)

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


@hookimpl
def nam_check_config(config, device):
    model = config.model
    if model.ssm_backend != NAME:
        return []
    checks = []
    widths = (f"d_state {model.d_state}, headdim {model.mamba_headdim}, rank {model.mamba_mimo_rank}, "
              f"chunk {model.mamba_chunk}, ngroups {model.mamba_ngroups}")
    problem = shape_problem(model)
    checks.append(Check(NAME, "kernel shapes", FAIL if problem else PASS,
                        "widths mamba-ssm's Mamba-3 kernels compile for", f"{widths}: {problem}" if problem else widths,
                        hint=None if problem is None else f"NAM56R's widths (d_state 128, headdim 64, rank 4, "
                                                          f"chunk 16), {REFERENCE_HINT}"))
    return checks


@hookimpl
def nam_preflight(device, config):
    """On a real CUDA device: compile (or load) the MIMO kernels and launch them once against the reference."""
    from nam56r.config import NAM56RConfig

    model = config.model if config is not None else NAM56RConfig()
    if config is not None and model.ssm_backend != NAME:
        return []  # active but unused (the host's row says so): no minutes of kernel builds the run will not use
    if shape_problem(model) is not None:
        return []  # already a failed config check
    if model.mamba_mimo_rank == 1:
        return [Check(NAME, "kernel launch", SKIP, "a MIMO launch", "SISO model: its Triton kernels autotune at "
                      "the first training step (about 5 minutes on an H100); no launch here")]
    from nam_plugin_mamba_ssm import patches, selftest
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    needed = f"kernel == reference within {selftest.TOLERANCE:g} (output and every input gradient, ngroups 2 of 4 heads)"
    patches.apply_needed()  # a compile or launch failure raises: the host reports it as this plugin's failed check
    err, details = selftest.parity(MambaSSMScan(), n=model.d_state, p=model.mamba_headdim, r=model.mamba_mimo_rank,
                                   chunk_size=model.mamba_chunk)
    ok = err <= selftest.TOLERANCE
    checks = [Check(NAME, "kernel launch", PASS if ok else FAIL, needed,
                    f"worst relative error {err:.2e} (b=1 l={4 * model.mamba_chunk} h=4 g=2 bf16; seed {details['seed']})",
                    hint=None if ok else f"report it with the seed; meanwhile {REFERENCE_HINT}")]
    if config is not None:
        checks.append(build_run_shape(model, config.train.micro_batch_size))
    return checks


def build_run_shape(model, batch: int) -> Check:
    """Build (or read from TileLang's disk cache) the MIMO kernels for the run's own sizes, so the first
    training step launches at once: the kernels are compiled for exact batch, length, heads and groups."""
    from nam_plugin_mamba_ssm import mimo, upstream
    from nam_plugin_mamba_ssm.kernel_args import rotary_divisor

    chunk = model.mamba_chunk
    dims = mimo.Dims(batch, -(-model.seq_len // chunk) * chunk, model.mamba_heads, model.mamba_ngroups)
    n, angles = model.d_state, int(model.d_state * model.mamba_rope_fraction) // 2
    mimo.compiled(dims, n, model.mamba_headdim, model.mamba_mimo_rank, True, True, True, chunk,
                  rotary_divisor(n, angles), "bfloat16", False, mimo.STAGES)
    return Check(NAME, "kernel build", PASS, f"the MIMO kernels built for this run's sizes ({dims.b} x {dims.s} "
                 f"tokens, {dims.h} heads in {dims.g} groups)", f"built or read from {upstream.tilelang_cache()}")


@hookimpl
def nam_register_ssm_backends(register):
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    register(NAME, MambaSSMScan)


@hookimpl
def nam_register_patches(register):
    from nam_plugin_mamba_ssm.patches import make_patches

    for name, patch in make_patches().items():
        register(name, patch)
