"""Mamba-3 MIMO forward and backward drivers over mamba-ssm's TileLang kernels: static shapes, any ngroups.

mamba-ssm's autograd function (``mamba3_mimo.py``) calls two module-level drivers, ``mamba_mimo_forward``
and ``mamba_mimo_bwd_combined``; the patch lane swaps in the two drivers below, with the same signatures
(``patches.py``), and leaves the autograd function, its Triton helpers and the kernels themselves as they are.
What the drivers change:

* **Host time.** Upstream's drivers call the ``@tilelang.jit`` kernel factory on every call. In TileLang
  0.1.8 that re-runs the eager front end (re-parsing and re-building the kernel program: 235 ms of host time
  a warm call in the patch's reproducer on the H100 host, ~775 ms when first seen at a full NAM56R layer) before
  the compiled-kernel cache is consulted. ``compiled()`` builds each kernel set once and keeps the kernel object,
  so a warm call is a launch.
* **Static shapes.** Upstream 2.3.2.post1 declares batch, length, heads and groups ``T.dynamic`` (its PR #963);
  the kernels built that way run 1.7-1.9x slower than the same kernels built for exact sizes (H100, NAM56R's
  shape, batch 1 and 2: scan fwd+bwd 19.29 -> 10.24 ms and 27.36 -> 15.77 ms; upstream reverted it in PR #968,
  in no release yet). ``compiled()`` builds for the exact (batch, padded length, heads, groups): NAM56R trains
  at one shape, so a run builds one set (plus preflight's self-test shape), kept in a bounded cache
  (``KEEP``) and on disk by TileLang (``nam_core.cache``: a second run on the machine starts in seconds).
  The patch-lane entry ``mamba3-mimo-static-shapes`` turns this on (``STATIC``); off, the drivers build as the
  installed upstream's do: the baseline row of ``bench/mimo_scan.py``.
* **Groups.** The backward kernels already write dQ and dK per head, ``[b, l, r, h, n]``; upstream then
  handles only ngroups 1 and ngroups == nheads and raises ``G value of 8 is not currently supported!``
  otherwise. ``reduce_groups`` covers every ``h % g == 0``: the bias gradients are per-head sums of those
  unreduced tensors, and dQ/dK sum the heads of each group (head ``i`` reads group ``i // (h / g)``).

* **Group sums, three forms** (``use_group_sums``: the option ``mamba-ssm.group_sums``, or the model's
  ``compile_glue``): ``reduce_groups`` reads the per-head dQ and dK ``[b, l, r, h, n]`` twice each (bias sum,
  group sum); at NAM56R's MBS 4 those four reads are ~39 ms of a 1,763 ms step (bench/results/glue.md).
  ``compiled`` runs it as one ``torch.compile`` region (still two reads: the sums run over different axes);
  ``fused`` as one Triton kernel that reads each gradient once (``group_sums.py``; the scan's default, 1.31x
  eager). ``bench/glue.py`` times all three, ``bench/group_sums.py`` the kernel's tiles.

Allocation, launch order and the Triton post-processing follow upstream's drivers, so the two compute the same
numbers wherever upstream runs.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from contextlib import contextmanager
from typing import Iterator, NamedTuple

import torch

from nam56r.regions import Region
from nam_plugin_mamba_ssm import upstream

FWD_THREADS, BWD_FWD_THREADS, BWD_BWD_THREADS = 128, 128, 256
"""Thread counts upstream's drivers launch with (its defaults)."""


class Stages(NamedTuple):
    """TileLang's software-pipelining depth (``num_stages``) of each kernel's loop over chunks."""

    fwd: int = 0
    bwd_fwd: int = 0
    bwd_bwd: int = 0


STAGES = Stages()
"""The depths the drivers build with: upstream's drivers launch every kernel at 0. ``bench/mimo_stages.py``
times the other depths at NAM56R's shape and checks them against these."""


class Kernels(NamedTuple):
    fwd: object
    bwd_fwd: object
    bwd_bwd: object


class Dims(NamedTuple):
    """The sizes upstream declares dynamic: batch, length (a whole number of chunks), heads, groups."""

    b: int
    s: int
    h: int
    g: int


STATIC = False
"""Build each kernel set for its exact ``Dims``, whatever the installed upstream does. Set by the patch-lane entry
``mamba3-mimo-static-shapes``; while False the drivers build as upstream's own drivers do (dynamic sizes in
2.3.2.post1, exact sizes in a release with PR #968), which is the baseline row of ``bench/mimo_scan.py``."""

KEEP = 8
"""Kernel sets kept per process (least recently used goes first). A NAM56R run uses one or two: its own shape and
preflight's self-test shape."""

BUILD_SECONDS = 180
"""Roughly how long TileLang 0.1.8 takes to build the three kernels on the H100 host when its disk cache does not
have them (measured 2026-11-22); a set read from the cache takes seconds."""


_OUTPUT_UNUSED = False


@contextmanager
def output_unused() -> Iterator[None]:
    """Forward calls inside skip the forward kernel: their output is allocated, not computed. Upstream's
    autograd function saves its inputs only (its backward recomputes the chunk states in ``bwd_fwd``), so a
    replay that only rebuilds those saved inputs (``MambaSSMScan.for_backward_only``) needs no output."""
    global _OUTPUT_UNUSED
    was, _OUTPUT_UNUSED = _OUTPUT_UNUSED, True
    try:
        yield
    finally:
        _OUTPUT_UNUSED = was


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else str(dtype)


def compiled(dims: Dims, n: int, p: int, r: int, has_z: bool, has_d: bool, reduce_o: bool, chunk_size: int,
             rotary_dim_divisor: int, dtype: str, return_state: bool = False, stages: Stages = Stages()) -> Kernels:
    """The three TileLang kernels for ``dims`` (ignored where upstream builds dynamic sizes and ``STATIC`` is
    off) and one static configuration, built or read from TileLang's disk cache on first use and kept (``KEEP``)."""
    static = STATIC or not upstream_builds_dynamic()
    return _build(dims if static else None, n, p, r, has_z, has_d, reduce_o, chunk_size, rotary_dim_divisor, dtype,
                  return_state, stages)


@functools.cache
def upstream_builds_dynamic() -> bool:
    """The installed mamba-ssm's drivers build with dynamic sizes (read once per process from its source)."""
    return upstream.builds_dynamic_shapes()


@functools.lru_cache(maxsize=KEEP)
def _build(dims: Dims | None, n, p, r, has_z, has_d, reduce_o, chunk_size, rotary_dim_divisor, dtype, return_state,
           stages) -> Kernels:
    language = upstream.load("tilelang.language")
    fwd_mod, bwd_mod = upstream.load(upstream.MIMO_FWD_MODULE), upstream.load(upstream.MIMO_BWD_MODULE)
    what = (f"d_state {n}, headdim {p}, rank {r}, chunk {chunk_size}, {dtype}, pipelining {tuple(stages)}")
    if dims is None:
        sizes, shape = [language.dynamic(x) for x in "BSHG"], "dynamic batch, length, heads and groups"
    else:
        sizes, shape = list(dims), f"batch {dims.b} x {dims.s} tokens, {dims.h} heads in {dims.g} groups"
    _say(f"building the Mamba-3 MIMO kernels for {shape} ({what}): up to about {BUILD_SECONDS // 60} minutes if "
         f"TileLang's cache ({upstream.tilelang_cache()}) does not have them, seconds if it does")
    start = time.perf_counter()
    static = (n, p, r, has_z, has_d, reduce_o)
    fwd = fwd_mod.mamba_mimo_fwd(*sizes, *static, return_final_state=return_state, chunk_size=chunk_size,
                                 rotary_dim_divisor=rotary_dim_divisor, dtype=dtype, threads=FWD_THREADS,
                                 num_stages=stages.fwd)
    bwd_fwd = bwd_mod.mamba_mimo_bwd_fwd(*sizes, *static, chunk_size, rotary_dim_divisor, dtype,
                                         BWD_FWD_THREADS, stages.bwd_fwd)
    bwd_bwd = bwd_mod.mamba_mimo_bwd_bwd(*sizes, *static, chunk_size, rotary_dim_divisor, dtype,
                                         BWD_BWD_THREADS, stages.bwd_bwd)
    _say(f"built the Mamba-3 MIMO kernels for {shape} in {time.perf_counter() - start:.0f} s")
    return Kernels(fwd, bwd_fwd, bwd_bwd)


def _say(line: str) -> None:
    """One line on the process's log (stderr: the run log of either engine)."""
    print(f"nam mamba-ssm: {line}", file=sys.stderr, flush=True)


def reduce_groups(d_per_head: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, l, r, h, n]`` per-head gradient of the biased B or C -> (bias grad ``[h, r, n]`` fp32, grad of the
    ``[b, l, r, g, n]`` input).

    The bias is added per head, so its gradient sums the per-head tensor over batch and time; the input is
    shared by the ``h / g`` consecutive heads of a group, so its gradient sums those heads. Both sums
    accumulate in fp32 at least; the bias gradient is fp32 (the biases are fp32 parameters), the input gradient
    comes back in the per-head tensor's dtype.
    """
    b, l, r, h, n = d_per_head.shape
    if h % groups:
        raise ValueError(f"{h} heads do not split into {groups} groups")
    acc = torch.promote_types(d_per_head.dtype, torch.float32)
    bias = d_per_head.sum(dim=(0, 1), dtype=acc).transpose(0, 1).to(torch.float32)
    grouped = d_per_head.view(b, l, r, groups, h // groups, n).sum(dim=4, dtype=acc)
    return bias, grouped.to(d_per_head.dtype)


COMPILED_REDUCE = Region(reduce_groups, "compile_glue")
"""``reduce_groups`` under ``torch.compile`` (nam56r/regions.py): one graph per shape, no eager fall-back."""
GROUP_SUMS = ("eager", "compiled", "fused")
"""The forms of ``reduce_groups`` the backward can run (the option ``mamba-ssm.group_sums``)."""
_reduce = reduce_groups


def use_group_sums(kind: str) -> None:
    """Make ``backward`` reduce the groups with ``reduce_groups`` (``eager``), ``COMPILED_REDUCE`` (``compiled``)
    or ``group_sums.fused_reduce_groups`` (``fused``, Triton). Process-wide, set by the scan a run builds
    (``MambaSSMScan.build``): a choice of speed, not of result (the forms differ only in the order of fp32
    additions)."""
    global _reduce
    if kind not in GROUP_SUMS:
        raise ValueError(f"group sums {kind!r}: expected one of {', '.join(GROUP_SUMS)}")
    if kind == "fused":
        from nam_plugin_mamba_ssm.group_sums import fused_reduce_groups

        _reduce = fused_reduce_groups
    else:
        _reduce = COMPILED_REDUCE if kind == "compiled" else reduce_groups


def forward(q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, D, mimo_z, angles, dA_cs, dA_cs_rev, dt, trap, segsum,
            chunk_size, rotary_dim_divisor, dtype, return_state=False, threads=FWD_THREADS, num_stages=0):
    """Upstream's ``mamba_mimo_forward`` contract: ``(out, final_state or None, final_k or None)``. The launch
    settings are this module's (``FWD_THREADS``, ``STAGES``); a caller asking for others is refused."""
    if (threads, num_stages) != (FWD_THREADS, 0):
        raise ValueError(f"the MIMO forward launches with threads={FWD_THREADS} and nam's STAGES; "
                         f"got a request for threads={threads}, num_stages={num_stages}")
    b, s, r, g, n = q.shape
    h, p = v.shape[-2:]
    reduce_o = mimo_o is not None
    name = dtype_name(dtype)
    out_dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, name)
    kernels = compiled(Dims(b, s, h, g), n, p, r, z is not None, D is not None, reduce_o, chunk_size,
                       rotary_dim_divisor, name, return_state, STAGES)
    dev = q.device
    out = torch.empty((b, s, h, p) if reduce_o else (b, s, r, h, p), device=dev, dtype=out_dtype)
    # The kernel declares every tensor; absent optional inputs get unread placeholders, as upstream passes.
    mimo_o_arg = mimo_o if reduce_o else torch.empty((h, r, p), device=dev, dtype=torch.float32)
    z_arg = z if z is not None else torch.empty((b, s, h, p), device=dev, dtype=out_dtype)
    d_arg = D if D is not None else torch.empty((h,), device=dev, dtype=torch.float32)
    mimo_z_arg = mimo_z if mimo_z is not None else torch.empty((h, r, p), device=dev, dtype=torch.float32)
    final_state = torch.empty((b, h, n, p), device=dev, dtype=torch.float32) if return_state else None
    final_k = torch.empty((b, r, h, n), device=dev, dtype=out_dtype) if return_state else None
    if _OUTPUT_UNUSED and return_state:
        raise ValueError("output_unused: a forward that returns its final state computes it; ask without one")
    if not _OUTPUT_UNUSED:
        kernels.fwd(q, k, v, out, q_bias, k_bias, mimo_v, mimo_o_arg, z_arg, d_arg, mimo_z_arg, angles, dA_cs,
                    dA_cs_rev, dt, trap, segsum, final_state, final_k)
    return out, final_state, final_k


def backward(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, z, mimo_z, angles, dA_cs, dA_cs_rev, dt, trap, D,
             segsum, chunk_size, rotary_dim_divisor, dtype, bf_threads=BWD_FWD_THREADS, bf_num_stages=0,
             bb_threads=BWD_BWD_THREADS, bb_num_stages=0):
    """Upstream's ``mamba_mimo_bwd_combined`` contract, for any ``h % g == 0``. Returns
    ``(dq, dk, dv, d_adt, d_dt, d_trap, dq_bias, dk_bias, dmimo_v, dmimo_z, dmimo_o, d_angles, dD, dz)``."""
    if (bf_threads, bf_num_stages, bb_threads, bb_num_stages) != (BWD_FWD_THREADS, 0, BWD_BWD_THREADS, 0):
        raise ValueError("the MIMO backward launches with upstream's default threads and nam's STAGES; got a "
                         "request for others")
    utils = upstream.load("mamba_ssm.ops.triton.mamba3.mamba3_mimo_utils")
    b, s, r, g, n = q.shape
    h, p = v.shape[-2:]
    reduce_o, has_z, has_d = mimo_o is not None, z is not None, D is not None
    kernels = compiled(Dims(b, s, h, g), n, p, r, has_z, has_d, reduce_o, chunk_size, rotary_dim_divisor,
                       dtype_name(dtype), False, STAGES)
    chunks = math.ceil(s / chunk_size)
    f32, dev = torch.float32, q.device

    # Pass 1: recompute the chunk states (stored in v's dtype, as upstream) and the gate/output-projection grads.
    dmimo_o = torch.empty((b, h, r, p), dtype=f32, device=dev) if reduce_o else None
    states = torch.empty((b, h, chunks, n, p), dtype=v.dtype, device=dev)
    dz = torch.empty_like(v) if has_z else None
    dmimo_z = torch.empty((b, h, r, p), dtype=f32, device=dev) if has_z else None
    qk_dot = torch.zeros((b, h, s, r, r), dtype=q.dtype, device=dev)
    kernels.bwd_fwd(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, dmimo_o, states, z, mimo_z, dz, dmimo_z,
                    angles, dA_cs, dA_cs_rev, dt, trap, D, qk_dot, segsum)

    # Pass 2: reverse over chunks; dq, dk per head.
    dq_heads = torch.empty((b, s, r, h, n), dtype=q.dtype, device=dev)
    dk_heads = torch.empty((b, s, r, h, n), dtype=k.dtype, device=dev)
    dv = torch.empty_like(v)
    dmimo_v = torch.empty((b, h, r, p), dtype=f32, device=dev)
    dD = torch.empty((b, h), dtype=D.dtype, device=dev) if has_d else None
    d_angles = torch.zeros((b, s, h, n // rotary_dim_divisor), dtype=angles.dtype, device=dev)
    dfactor, dgamma_diag, d_adt, ddA_cs_rev, ddA_cs = (torch.zeros((b, h, s), dtype=f32, device=dev)
                                                        for _ in range(5))
    dSSdA = torch.zeros((b, h, chunks, chunk_size, chunk_size), dtype=f32, device=dev)
    kernels.bwd_bwd(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, dk_heads.view(b, s * r, h, n), dv, dmimo_v,
                    states, dq_heads.view(b, s * r, h, n), z, mimo_z, angles, dA_cs, dA_cs_rev, dt, trap, dfactor,
                    dgamma_diag, d_angles, D, dD, qk_dot, d_adt, dSSdA, ddA_cs_rev, ddA_cs, segsum)

    dq_bias, dq = _reduce(dq_heads, g)
    dk_bias, dk = _reduce(dk_heads, g)
    d_dt, d_trap = utils.bwd_dtrap_ddt_triton(trap, dt, dfactor, dgamma_diag, chunk_size)
    d_adt += utils.bwd_dadt_fused_triton(dSSdA, segsum, ddA_cs, ddA_cs_rev, dA_cs, dA_cs_rev, chunk_size)
    return (dq, dk, dv, d_adt, d_dt, d_trap, dq_bias, dk_bias, dmimo_v.sum(0), None if dmimo_z is None else
            dmimo_z.sum(0), None if dmimo_o is None else dmimo_o.sum(0), d_angles, None if dD is None else dD.sum(0),
            dz)
