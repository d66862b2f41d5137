"""``MambaSSMScan``: nam's ``SSMScan`` contract (nam56r/backends.py) on mamba-ssm's Mamba-3 kernels.

Rank 1 (SISO) goes to ``mamba3_siso_combined`` (Triton), rank > 1 (MIMO) to ``mamba3_mimo`` (TileLang, with
the drivers of ``mimo.py`` swapped in by the patch lane). Both take the contract's tensors nearly as they
are: the contract was written in the kernels' layouts and rotation conventions. What the scan adds:

* the layout of SISO's rank-free tensors (``q``/``k`` ``[b, l, g, n]``, biases ``[h, n]``);
* the dtypes the kernels read: q, k, v, z and the trapezoid in the activation dtype, biases, MIMO projections,
  D, angles, A*dt and dt in fp32 (the MIMO projections are cast here, so their gradients come back in the
  parameters' dtype);
* contiguous copies where the mixer hands views (``adt``, ``dt``, ``trap`` are transposes; ``angles`` is one
  set broadcast over heads, which the kernels read per head);
* MIMO at a length that is not a multiple of the chunk: upstream's forward handles the ragged tail, but its
  backward's Triton post-pass asserts ``S % chunk_size == 0``. The scan pads the sequence at its end with
  zeros (A*dt = dt = 0: padded steps neither decay nor add to the state) and drops those positions again;
  the scan is causal, so no real position sees them, and their gradients are discarded by the slice.

It refuses, rather than converts, what the kernels would compute differently: CPU tensors, an activation
dtype other than bf16 (SISO casts its inputs to bf16 whatever they are; MIMO is measured here in bf16 only),
and a MIMO run whose patches are not in effect (upstream would raise for ngroups 8, or spend most of a step
re-building kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nam_core.errors import NamError
from nam_plugin_mamba_ssm import upstream
from nam_plugin_mamba_ssm.kernel_args import mimo_args, rotary_divisor, siso_args  # noqa: F401  (tests import them here)

SUPPORTED_DTYPES = (torch.bfloat16,)


class MambaSSMScan:
    """The ``ssm_mixers: mamba-ssm`` backend. Upstream modules are imported, and the MIMO patches checked, at the
    first call of each kind; after that a call does no host work beyond the launches."""

    def __init__(self):
        self._siso = self._mimo = None

    @classmethod
    def build(cls, ctx) -> "MambaSSMScan":
        """The scan a run builds (``nam56r.backends.build_backend``), and the MIMO backward's group sums it asks
        for (``mimo.use_group_sums``): the option ``mamba-ssm.group_sums`` when set, else ``fused``, the fastest
        form measured (one read, 1.31x eager on an H200; compiled was 0.50x, so ``compile_glue`` does not touch
        them)."""
        from nam_plugin_mamba_ssm import mimo
        from nam_plugin_mamba_ssm.plugin import NAME

        options = ctx.options.get(NAME)
        chosen = options.group_sums if options is not None else None
        mimo.use_group_sums(chosen or "fused")
        return cls()

    def __call__(self, q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, *,
                 chunk_size: int) -> torch.Tensor:
        if not v.is_cuda:
            raise NamError(f"the mamba-ssm scan runs CUDA tensors only; got {v.device}",
                           hint="--device cuda, or the pure-PyTorch scan: --set ssm_backend=reference --plugins "
                                "reference")
        if v.dtype not in SUPPORTED_DTYPES:
            raise NamError(f"the mamba-ssm scan runs bf16 activations; got {v.dtype} (the SISO kernel would cast "
                           "them to bf16 silently, and MIMO is not measured in other dtypes)",
                           hint="--set train.dtype=bfloat16, or --set ssm_backend=reference")
        if q.shape[2] == 1:
            if self._siso is None:
                self._siso = upstream.load(upstream.SISO_MODULE).mamba3_siso_combined
            return self._siso(*siso_args(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z),
                              chunk_size=chunk_size)
        if self._mimo is None:
            from nam_plugin_mamba_ssm.patches import require_mimo_fixes

            require_mimo_fixes()
            self._mimo = upstream.load(upstream.MIMO_MODULE).mamba3_mimo
        l = v.shape[1]
        q, k, v, adt, dt, trap, angles, z = pad_to_chunks(q, k, v, adt, dt, trap, angles, z, chunk_size=chunk_size)
        y = self._mimo(*mimo_args(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o,
                                  chunk_size=chunk_size))
        return y[:, :l] if y.shape[1] != l else y

    def for_backward_only(self, q, k, v, *args, chunk_size: int) -> torch.Tensor:
        """``nam56r.backends.SSMScan.for_backward_only``: a call whose output values are not read. MIMO skips its
        forward kernel (``mimo.output_unused``: upstream's backward reads the saved inputs only), which is most
        of a ``train.recompute=mamba-scan`` replay; SISO runs as a call."""
        if q.shape[2] == 1:
            return self(q, k, v, *args, chunk_size=chunk_size)
        from nam_plugin_mamba_ssm import mimo

        with mimo.output_unused():
            return self(q, k, v, *args, chunk_size=chunk_size)


def pad_to_chunks(q, k, v, adt, dt, trap, angles, z, *, chunk_size: int) -> tuple:
    """Zero-pad every per-token argument at the end of the sequence to a whole number of chunks (unchanged if
    it already is). Time is dim 1 of q, k, v, angles, z and dim 2 of adt, dt, trap."""
    pad = -v.shape[1] % chunk_size
    if not pad:
        return q, k, v, adt, dt, trap, angles, z
    q, k, v, angles, z = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (q, k, v, angles, z))
    adt, dt, trap = (F.pad(t, (0, pad)) for t in (adt, dt, trap))
    return q, k, v, adt, dt, trap, angles, z
