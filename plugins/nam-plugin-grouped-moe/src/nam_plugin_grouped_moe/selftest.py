"""The activation self-test on a real CUDA device: the grouped experts against the fp32 reference experts
(``nam56r.testing.compare_experts``: 512 tokens, 8 experts of 64, top-2, fresh random inputs)."""

from __future__ import annotations

from nam_core.checks import Measured
from nam_plugin_grouped_moe.plugin import TOLERANCE


def launch(spec) -> Measured:
    from nam56r.testing import compare_experts, worst_error
    from nam_plugin_grouped_moe.experts import GroupedExperts

    r = compare_experts(GroupedExperts(), device="cuda")
    found = (", ".join(f"{k} {v:.2e}" for k, v in r.items() if k != "seed")
             + f" (512 tokens, 8 experts of 64, top-2; seed {r['seed']})")
    return Measured(worst_error(r) <= TOLERANCE, found)
