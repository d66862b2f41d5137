"""What the host runs on a real CUDA device before a run uses the scan (``PLUGIN.checks``): the MIMO kernels
compiled (or loaded) and launched once against the reference, then built for the run's own sizes."""

from __future__ import annotations

from nam_core.checks import Measured


def _model(spec):
    from nam56r.config import NAM56RConfig

    return spec.model if spec is not None else NAM56RConfig()


def launch(spec) -> Measured:
    """The scan against the reference at the model's widths (NAM56R's without a run); SISO: a skipped row."""
    from nam_plugin_mamba_ssm import patches, selftest
    from nam_plugin_mamba_ssm.scan import MambaSSMScan

    model = _model(spec)
    if model.mamba_mimo_rank == 1:
        return Measured(None, "SISO model: its Triton kernels autotune at the first training step (about 5 minutes "
                        "on an H100); no launch here", "a MIMO launch")
    needed = f"kernel == reference within {selftest.TOLERANCE:g} (output and every input gradient)"
    patches.apply_needed()  # a compile or launch failure raises: the host reports it as this plugin's failed check
    widths = dict(n=model.d_state, p=model.mamba_headdim, r=model.mamba_mimo_rank, chunk_size=model.mamba_chunk)
    if spec is None:  # no run: a small size of the model's widths (one kernel build of its own)
        err, details = selftest.parity(MambaSSMScan(), **widths)
        where = f"b=1 l={4 * model.mamba_chunk} h=4 g=2"
    else:  # the run's size: the build this launch pays is the run's own (``build`` below then reads it back)
        dims = _run_dims(spec)
        err, details = selftest.parity_at(MambaSSMScan(), *dims, **widths)
        where = f"b={dims[0]} l={dims[1]} h={dims[2]} g={dims[3]}, reference on group 0"
    return Measured(err <= selftest.TOLERANCE, f"worst relative error {err:.2e} ({where} bf16; seed "
                    f"{details['seed']})", needed)


def _run_dims(spec) -> tuple[int, int, int, int]:
    """(batch, padded length, heads, groups): the exact size the run's MIMO kernels are compiled for."""
    model, chunk = spec.model, spec.model.mamba_chunk
    return (spec.train.micro_batch_size, -(-model.seq_len // chunk) * chunk, model.mamba_heads, model.mamba_ngroups)


def build(spec) -> Measured | None:
    """Build (or read from TileLang's disk cache) the MIMO kernels for the run's own sizes, so the first training
    step launches at once: the kernels are compiled for exact batch, length, heads and groups. No row without a
    run, or for a SISO model."""
    if spec is None or spec.model.mamba_mimo_rank == 1:
        return None
    from nam_plugin_mamba_ssm import mimo, upstream
    from nam_plugin_mamba_ssm.kernel_args import rotary_divisor

    model, chunk = spec.model, spec.model.mamba_chunk
    dims = mimo.Dims(*_run_dims(spec))
    n, angles = model.d_state, int(model.d_state * model.mamba_rope_fraction) // 2
    mimo.compiled(dims, n, model.mamba_headdim, model.mamba_mimo_rank, True, True, True, chunk,
                  rotary_divisor(n, angles), "bfloat16", False, mimo.STAGES)
    return Measured(True, f"built or read from {upstream.tilelang_cache()}", f"the MIMO kernels built for this run's "
                    f"sizes ({dims.b} x {dims.s} tokens, {dims.h} heads in {dims.g} groups)")
