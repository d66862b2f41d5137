"""The arguments mamba-ssm's Mamba-3 kernels take, from nam's ``SSMScan`` contract (nam56r/backends.py): the
layouts, dtypes and contiguity each entry point reads. Shared by the scan (``scan.py``), the patch lane's
reproducers (``patches.py``) and the benches, so none of them imports another for it."""

from __future__ import annotations

import torch

from nam_core.errors import NamError


def _act(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.dtype).contiguous()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def siso_args(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z) -> tuple:
    """Positional arguments of ``mamba3_siso_combined(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z)``:
    ``Q, K [b, l, g, n]`` and biases ``[h, n]`` (the contract's rank axis of 1 dropped); activations and the
    angles in v's dtype (upstream casts the angles to bf16 itself: handing them over in bf16 saves an fp32
    copy of ``[b, l, h, s]``), the rest fp32; all contiguous."""
    return (_act(q.squeeze(2), v), _act(k.squeeze(2), v), _act(v, v), _f32(adt), _f32(dt), _act(trap, v),
            _f32(q_bias.squeeze(1)), _f32(k_bias.squeeze(1)), _act(angles, v), _f32(d), _act(z, v))


def mimo_args(q, k, v, adt, dt, trap, q_bias, k_bias, angles, d, z, mimo_x, mimo_z, mimo_o, *,
              chunk_size: int) -> tuple:
    """Positional arguments of ``mamba3_mimo(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out,
    Angles, D, Z, chunk_size, rotary_dim_divisor, dtype)``: the contract's layouts as they are; activations in
    v's dtype, biases, projections, angles, D, A*dt and dt fp32; all contiguous."""
    return (_act(q, v), _act(k, v), _act(v, v), _f32(adt), _f32(dt), _act(trap, v), _f32(q_bias), _f32(k_bias),
            _f32(mimo_x), _f32(mimo_z), _f32(mimo_o), _f32(angles), _f32(d), _act(z, v), chunk_size,
            rotary_divisor(q.shape[-1], angles.shape[-1]), v.dtype)


def rotary_divisor(n: int, angles: int) -> int:
    """mamba-ssm's ``rotary_dim_divisor``: the MIMO kernels read ``n / divisor`` angles per head, one per rotated
    pair, so rope fraction 0.5 (n=128: 32 angles) gives 4 and fraction 1.0 (64 angles) gives 2."""
    if angles <= 0 or n % angles or n // angles not in (2, 4):
        raise NamError(f"the MIMO kernels rotate all (n/2 angles) or half (n/4 angles) of the {n} state dims; "
                       f"got {angles} angles", hint="--set mamba_rope_fraction=0.5 (or 1.0)")
    return n // angles
