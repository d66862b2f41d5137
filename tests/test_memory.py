"""nam56r/memory.py: the megatron engine's per-GPU memory plan, static part counted, the rest measured."""

import json
from pathlib import Path

import pytest

from nam56r.memory import GIB, OTHER_GIB_PER_SEQUENCE, largest_mbs, megatron_plan, parameter_split
from nam56r.pattern import resolve
from nam56r.recipes import get_recipe

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "megatron_throughput_x2.json"


@pytest.fixture(scope="module")
def split():
    return parameter_split(get_recipe("nam56r").model)


def test_split_counts_every_parameter_once(split):
    dense, routed = split
    assert dense + routed == pytest.approx(4.73e9, rel=2e-3)
    cfg = get_recipe("nam56r").model
    plan = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
    moe_layers = sum(layer.symbol == "E" for layer in plan.layers)
    assert routed == moe_layers * cfg.num_experts * 3 * cfg.hidden * cfg.moe_ffn_hidden  # gate, up, down


def test_static_part_by_hand():
    plan = megatron_plan(800, 200, world=4, ep=2, mbs=3, other_gib_per_sequence=1.0)
    local = 800 + 200 / 2
    assert plan.weights_gib * GIB == pytest.approx(2 * local) and plan.grads_gib * GIB == pytest.approx(4 * local)
    assert plan.optimizer_gib * GIB == pytest.approx(12 * (800 / 4 + 100 / 2))  # experts sharded over world/ep
    assert plan.other_gib == 3.0 and plan.total_gib == pytest.approx(plan.static_gib + 3.0)
    with pytest.raises(ValueError, match="ep dividing world"):
        megatron_plan(800, 200, world=4, ep=3, mbs=1)


def test_calibrated_on_one_gpu_it_predicts_the_two_gpu_peak(split):
    """The constant comes from the 1-GPU row; the 2-GPU row (EP 2) is a prediction it must meet."""
    rows = {r["gpus"]: r for r in json.loads(RESULTS.read_text())["rows"] if r["engine"] == "megatron"}
    one = megatron_plan(*split, world=1, ep=1, mbs=1)
    assert one.total_gib == pytest.approx(rows[1]["peak_gib"], abs=0.1)
    two = megatron_plan(*split, world=2, ep=2, mbs=1)
    assert two.total_gib == pytest.approx(rows[2]["peak_gib"], abs=0.5)


def test_largest_mbs_fits_and_one_more_does_not(split):
    for world, ep in ((4, 4), (8, 8)):
        mbs = largest_mbs(*split, world=world, ep=ep)
        assert mbs >= 1
        assert megatron_plan(*split, world=world, ep=ep, mbs=mbs).total_gib <= 139.0
        assert megatron_plan(*split, world=world, ep=ep, mbs=mbs + 1).total_gib > 139.0
    assert largest_mbs(*split, world=1, ep=1, capacity_gib=80.0) == 0  # an H100 cannot hold it with this engine
    assert OTHER_GIB_PER_SEQUENCE > 0
