"""The parity launches the host runs on a real CUDA device for each part the run turns on (``plugin.CHECKS``):
FP8 against fp32, at the tolerances ``plugin.py`` states."""

from __future__ import annotations

from nam_core.checks import Measured
from nam_plugin_float8.plugin import EXPERTS_TOLERANCE, LINEARS_TOLERANCE, parts_of


def linears(spec) -> Measured:
    """A ``Float8Linear``'s output, input and weight gradients against ``nn.Linear`` in fp32 (4096 tokens,
    1024 -> 2048), in the run's recipe (rowwise without a run)."""
    from nam_plugin_float8.linears import linear_error

    recipe = parts_of(spec)["linears"]
    r = linear_error(recipe)
    found = ", ".join(f"{k} {v:.3f}" for k, v in r.items()) + f" ({recipe}; 4096 tokens, 1024 -> 2048)"
    return Measured(max(r.values()) <= LINEARS_TOLERANCE, found)


def experts(spec) -> Measured:
    """The FP8 grouped experts against the fp32 reference experts (512 tokens, 8 experts of 64, top-2)."""
    from nam56r.testing import compare_experts, worst_error
    from nam_plugin_float8.experts import Float8GroupedExperts

    r = compare_experts(Float8GroupedExperts(), device="cuda")
    found = (", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "seed")
             + f" (512 tokens, 8 experts of 64, top-2; seed {r['seed']})")
    return Measured(worst_error(r) <= EXPERTS_TOLERANCE, found)
