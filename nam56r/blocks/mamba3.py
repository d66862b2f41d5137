"""Mamba-3 mixer: in_proj, the per-token SSM coefficients, the scan a backend runs, out_proj.

The block owns every parameter and everything cheap (projections, softplus, BC-norm); the ``SSMScan`` it is
given owns the recurrence (nam56r/backends.py, math in kernels-and-math.md section 1.2). Parameters follow
mamba-ssm's ``Mamba3`` (section 1.1) with ``is_outproj_norm=False``; there is no conv1d, the trapezoid rule
takes its place.

D, dt_bias, B_bias and C_bias stay fp32 even in a bf16 model: dt feeds exp(A dt) over thousands of tokens
and bf16 keeps 8 mantissa bits, so the module refuses to lower them (``_apply``) and the forward computes
dt and A dt in fp32 whatever the activations are.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nam56r.backends import SSMScan
from nam56r.config import NAM56RConfig
from nam56r.recompute import checkpointed
from nam56r.regions import Region
from nam56r.state import ForwardState
from nam_core.errors import CannotRunHere

DT_INIT_FLOOR = 1e-4  # mamba-ssm Mamba3 dt_init_floor default
BC_NORM_EPS = 1e-5  # mamba-ssm Mamba3 B_norm / C_norm eps


class Mamba3Mixer(nn.Module):
    """x [b, l, hidden] -> [b, l, hidden]. SISO when cfg.mamba_mimo_rank == 1, else MIMO of that rank."""

    FP32_PARAMS = ("D", "dt_bias", "B_bias", "C_bias")
    """Kept at fp32 or wider through ``module.to(dtype)``, ``.half()``, ``.bfloat16()``."""

    def __init__(self, cfg: NAM56RConfig, scan: SSMScan):
        super().__init__()
        self.cfg, self.scan = cfg, scan
        self.d_inner, self.heads, self.headdim = cfg.d_inner, cfg.mamba_heads, cfg.mamba_headdim
        self.d_state, self.groups, self.rank = cfg.d_state, cfg.mamba_ngroups, cfg.mamba_mimo_rank
        if self.d_inner % self.headdim or self.heads % self.groups or cfg.mamba_rope_fraction not in (0.5, 1.0):
            raise ValueError(
                f"Mamba-3 needs d_inner % headdim == 0, heads % ngroups == 0 and rope_fraction in (0.5, 1.0); "
                f"got d_inner={self.d_inner}, headdim={self.headdim}, heads={self.heads}, "
                f"ngroups={self.groups}, rope_fraction={cfg.mamba_rope_fraction}. Fix the recipe's mamba_* fields."
            )
        rotated = int(cfg.d_state * cfg.mamba_rope_fraction) // 2 * 2  # floor to even, as mamba-ssm
        self.angles = rotated // 2  # S: one angle per rotated pair (N=128, rope 0.5 -> 32)
        H, R, N, P = self.heads, self.rank, self.d_state, self.headdim
        bc = N * self.groups * R
        self.split_sizes = [self.d_inner, self.d_inner, bc, bc, H, H, H, self.angles]  # z x B C dt A trap angles

        self.in_proj = nn.Linear(cfg.hidden, sum(self.split_sizes), bias=False)
        self.dt_bias = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.B_bias = nn.Parameter(torch.empty(H, R, N, dtype=torch.float32))
        self.C_bias = nn.Parameter(torch.empty(H, R, N, dtype=torch.float32))
        self.B_norm = nn.RMSNorm(N, eps=BC_NORM_EPS)  # one weight over N, shared by ranks and groups
        self.C_norm = nn.RMSNorm(N, eps=BC_NORM_EPS)
        if R > 1:
            self.mimo_x = nn.Parameter(torch.empty(H, R, P))
            self.mimo_z = nn.Parameter(torch.empty(H, R, P))
            self.mimo_o = nn.Parameter(torch.empty(H, R, P))
        else:
            self.mimo_x = self.mimo_z = self.mimo_o = None
        self.D = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.out_proj = nn.Linear(self.d_inner, cfg.hidden, bias=False)
        for p in (self.dt_bias, self.D):
            p._no_weight_decay = True  # mamba-ssm convention, read by optimizer grouping
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.cfg
        nn.init.normal_(self.in_proj.weight, std=cfg.init_std)
        nn.init.normal_(self.out_proj.weight, std=cfg.init_std)
        # dt log-uniform in [dt_min, dt_max], floored, stored as softplus^-1(dt) = dt + log(1 - e^-dt).
        lo, hi = math.log(cfg.mamba_dt_min), math.log(cfg.mamba_dt_max)
        dt = torch.exp(torch.rand_like(self.dt_bias) * (hi - lo) + lo).clamp(min=DT_INIT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.B_bias.fill_(1.0)  # mamba-ssm: B/C biases start at 1
        self.C_bias.fill_(1.0)
        self.B_norm.reset_parameters()
        self.C_norm.reset_parameters()
        if self.rank > 1:  # mamba-ssm: x spread evenly over ranks, z gate as is, ranks averaged on the way out
            self.mimo_x.fill_(1.0 / self.rank)
            self.mimo_z.fill_(1.0)
            self.mimo_o.fill_(1.0 / self.rank)
        self.D.fill_(1.0)

    def _apply(self, fn, recurse=True):
        """Run ``fn`` (a device/dtype move) but put FP32_PARAMS back at fp32 if it narrowed them.

        The fp32 values are kept aside first, so going through bf16 loses no bits; a move to fp64 is allowed
        (the float64 test copy of a model).
        """
        kept = {name: getattr(self, name).detach().clone() for name in self.FP32_PARAMS}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            param = getattr(self, name)
            if param.dtype.is_floating_point and torch.finfo(param.dtype).bits < 32:
                param.data = value.to(device=param.device, dtype=torch.float32)
                if param.grad is not None:
                    param.grad = param.grad.to(torch.float32)
        return self

    recompute_scan: bool = False
    """``train.recompute=mamba-scan`` (``nam56r.recompute.apply``): the part between the two projections (the
    elementwise prelude and the scan) runs under ``checkpointed``, its input the in_proj output and its output
    out_proj's input, both kept ([b, l, 24992] and [b, l, 8192] bf16 per layer at NAM56R's width), so neither
    GEMM runs again. Nothing in that part keeps the scan's output for backward (the scan's own backward reads
    its inputs only), so the replay, which is there only to rebuild what the scan's backward reads, asks a
    backend that offers it for ``for_backward_only`` (``nam56r.backends.SSMScan``): mamba-ssm's then skips its
    forward kernel, and the replay costs the prelude."""

    def forward(self, x: torch.Tensor, state: ForwardState | None = None) -> torch.Tensor:
        """``state`` is accepted for the common block interface; Mamba-3 adds no auxiliary loss."""
        parts = self._project(x)
        if self.recompute_scan:
            passes = []

            def between(*args) -> torch.Tensor:  # (*parts, state)
                passes.append(None)
                return self._between(args[:-1], output_used=len(passes) == 1)  # a replay's output is dropped

            y = checkpointed(between, state, *parts)
        else:
            y = self._between(parts)
        return self.out_proj(y.flatten(2).to(x.dtype))  # y [b, l, H, P]

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """in_proj: ``(proj,)`` [b, l, sum(split_sizes)], or with ``mamba_split_in_proj`` ``(z, x, rest)``: three
        GEMMs on row slices of the same weight, so z and x [b, l, d_inner] come out contiguous and the scan's
        kernels read them without a copy (bench/results/glue.md, rank 3). The slices bypass whatever module
        holds the weight, so a swapped in_proj is refused rather than silently run in bf16 (te and float8.linears
        refuse the pair at config time; this check covers any other swap)."""
        if not self.cfg.mamba_split_in_proj:
            return (self.in_proj(x),)
        if type(self.in_proj) is not nn.Linear:
            raise CannotRunHere(
                f"mamba_split_in_proj=true runs in_proj as three GEMMs on slices of its weight; this in_proj is "
                f"{type(self.in_proj).__module__}.{type(self.in_proj).__qualname__} (a plugin swapped it), whose "
                "own forward the slices would skip", hint="--set mamba_split_in_proj=false")
        d = self.d_inner
        w_z, w_x, w_rest = self.in_proj.weight.split([d, d, self.in_proj.out_features - 2 * d], dim=0)
        return F.linear(x, w_z), F.linear(x, w_x), F.linear(x, w_rest)

    def _between(self, parts: tuple[torch.Tensor, ...], output_used: bool = True) -> torch.Tensor:
        """The in_proj output (``_project``) -> the scan's output [b, l, H, P] (prelude, scan). ``output_used``
        False: the values of the result are not read (a replay), a backend may leave them unset
        (``for_backward_only``)."""
        prelude = compiled_prelude() if self.cfg.mamba_compile_prelude else mamba3_prelude
        scan = self.scan if output_used else getattr(self.scan, "for_backward_only", self.scan)
        scan_inputs = prelude(
            parts[0] if len(parts) == 1 else tuple(parts), self.dt_bias, self.B_bias, self.C_bias,
            self.B_norm.weight, self.C_norm.weight,
            self.D, self.split_sizes, (self.rank, self.groups, self.d_state, self.heads, self.headdim),
            self.cfg.mamba_a_floor, BC_NORM_EPS,
        )
        return scan(*scan_inputs, self.mimo_x, self.mimo_z, self.mimo_o, chunk_size=self.cfg.mamba_chunk)


def mamba3_prelude(proj, dt_bias, B_bias, C_bias, B_norm_weight, C_norm_weight, D, split_sizes, dims, a_floor,
                   eps):
    """The mixer's elementwise region: in_proj output -> the ``SSMScan`` arguments up to ``z``.

    A free function of tensors and plain values (no module), so one ``torch.compile`` of it serves every layer
    of the same shape. dt and A dt in fp32 at least, even if a wrapper handed bf16 copies of the fp32
    parameters. ``dims`` = (R, G, N, H, P). ``proj``: in_proj's output ``[b, l, sum(split_sizes)]``, or its
    ``(z, x, rest)`` parts (``mamba_split_in_proj``), which hand z and x over as they are.
    """
    R, G, N, H, P = dims
    if isinstance(proj, torch.Tensor):
        z, xs, B, C, dd_dt, dd_A, trap, angles = torch.split(proj, split_sizes, dim=-1)
    else:
        z, xs, rest = proj
        B, C, dd_dt, dd_A, trap, angles = torch.split(rest, split_sizes[2:], dim=-1)
    b, l, _ = z.shape
    f32 = torch.promote_types(z.dtype, torch.float32)
    dt = F.softplus(dd_dt.to(f32) + dt_bias.to(f32))  # [b, l, H]
    # A = -softplus(dd_A) is mamba-ssm 2.3.2.post1; main (c69aaab) uses a heavy tail instead:
    # x + 1 for x >= 0, 1 / (1 - x) below (kernels-and-math.md section 1.2).
    A = (-F.softplus(dd_A.to(f32))).clamp(max=-a_floor)
    adt = (A * dt).transpose(1, 2)  # [b, H, l]
    S = angles.shape[-1]
    return (
        F.rms_norm(C.unflatten(-1, (R, G, N)), (N,), C_norm_weight, eps),  # q [b, l, R, G, N]
        F.rms_norm(B.unflatten(-1, (R, G, N)), (N,), B_norm_weight, eps),  # k
        xs.unflatten(-1, (H, P)),  # v [b, l, H, P]
        adt, dt.transpose(1, 2),
        trap.transpose(1, 2),  # [b, H, l], pre-sigmoid
        C_bias.to(f32), B_bias.to(f32),
        angles.to(f32).unsqueeze(2).expand(b, l, H, S),  # one set of angles, every head
        D.to(f32),
        z.unflatten(-1, (H, P)),
    )


_COMPILED_PRELUDE = None


def compiled_prelude():
    """``mamba3_prelude`` as a compiled region (nam56r/regions.py: ``torch.compile(fullgraph=True,
    dynamic=False)``, built on first use, shared by every layer). Without inductor on the device one
    ``CannotRunHere`` names ``mamba_compile_prelude``; compile errors propagate: no fall-back to the eager
    function."""
    global _COMPILED_PRELUDE
    if _COMPILED_PRELUDE is None:
        _COMPILED_PRELUDE = Region(mamba3_prelude, "mamba_compile_prelude")
    return _COMPILED_PRELUDE
