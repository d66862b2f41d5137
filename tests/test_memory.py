"""nam56r/memory.py: the megatron engine's per-GPU memory plan, static part counted, the rest measured."""

import json
from pathlib import Path

import pytest

from nam56r.memory import (GIB, H200_GIB, OTHER_GIB_FIXED, OTHER_GIB_PER_SEQUENCE, OUTSIDE_ALLOCATOR_GIB, largest_mbs,
                           megatron_plan, parameter_split)
from nam56r.pattern import resolve
from nam56r.recipes import get_recipe

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


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
    plan = megatron_plan(800, 200, world=4, ep=2, mbs=3, other_gib_per_sequence=1.0, other_gib_fixed=0.5)
    local = 800 + 200 / 2
    assert plan.weights_gib * GIB == pytest.approx(2 * local) and plan.grads_gib * GIB == pytest.approx(4 * local)
    assert plan.optimizer_gib * GIB == pytest.approx(12 * (800 / 4 + 100 / 2))  # experts sharded over world/ep
    assert plan.other_gib == 3.5 and plan.total_gib == pytest.approx(plan.static_gib + 3.5)
    assert plan.fits(plan.total_gib + OUTSIDE_ALLOCATOR_GIB) and not plan.fits(plan.total_gib + OUTSIDE_ALLOCATOR_GIB - 0.01)
    with pytest.raises(ValueError, match="ep dividing world"):
        megatron_plan(800, 200, world=4, ep=3, mbs=1)


def _peaks() -> dict:
    """(GPUs, MBS) -> measured megatron peak GiB, all from one 4x H200 session."""
    rows = [r for name in ("megatron_throughput_x4.json", "megatron_throughput_x4_mbs.json")
            for r in json.loads((RESULTS / name).read_text())["rows"] if r["engine"] == "megatron"]
    return {(r["gpus"], r["mbs"]): r["peak_gib"] for r in rows}


def test_fitted_at_ep4_it_predicts_the_other_runs(split):
    """The constants are fitted to EP 4 at MBS 1-3; EP 1 (MBS 1) and EP 2 (MBS 1 and 2) are predictions."""
    peaks = _peaks()
    for mbs in (1, 2, 3):
        assert megatron_plan(*split, world=4, ep=4, mbs=mbs).total_gib == pytest.approx(peaks[4, mbs], abs=0.2)
    for gpus, mbs in ((1, 1), (2, 1), (2, 2)):
        plan = megatron_plan(*split, world=gpus, ep=gpus, mbs=mbs)
        assert plan.total_gib == pytest.approx(peaks[gpus, mbs], abs=1.0), (gpus, mbs)


def test_largest_mbs_fits_and_one_more_does_not(split):
    for world, ep in ((4, 4), (8, 8)):
        mbs = largest_mbs(*split, world=world, ep=ep)
        assert mbs >= 1
        assert megatron_plan(*split, world=world, ep=ep, mbs=mbs).fits()
        assert not megatron_plan(*split, world=world, ep=ep, mbs=mbs + 1).fits()
    assert largest_mbs(*split, world=4, ep=4) == 3  # measured: MBS 3 ran at EP 4, MBS 4 ran out of memory
    assert largest_mbs(*split, world=1, ep=1, capacity_gib=80.0) == 0  # an H100 cannot hold it with this engine
    assert OTHER_GIB_PER_SEQUENCE > 0 and OTHER_GIB_FIXED >= 0 and H200_GIB > 139


def test_numerics_change_the_optimizer_bytes(split):
    fp32 = megatron_plan(*split, world=8, ep=8, mbs=1)
    moments = megatron_plan(*split, world=8, ep=8, mbs=1, numerics="bf16-moments")
    assert moments.optimizer_gib == pytest.approx(fp32.optimizer_gib * 8 / 12)
    from nam56r.memory import local_static_gib

    local = local_static_gib(1000, 2, "fp32-master")
    assert local["optimizer_gib"] * GIB == pytest.approx(12_000) and local["static_gib"] * GIB == pytest.approx(16_000)
    assert local_static_gib(1000, 2, "stochastic-rounding")["static_gib"] * GIB == pytest.approx(8_000)


def test_activations_by_kind_split_the_measured_total_and_recompute_keeps_inputs():
    """Without recompute the kinds sum to the measured per-sequence total; a recomputed mixer keeps two hidden
    vectors per token and layer (its input and its norm's), a recomputed layer one; the replay holds one layer."""
    from nam56r.memory import activations_by_kind, per_sequence_gib

    cfg = get_recipe("nam56r").model
    none = activations_by_kind(cfg, (), per_sequence=OTHER_GIB_PER_SEQUENCE)
    assert per_sequence_gib(none) == pytest.approx(OTHER_GIB_PER_SEQUENCE) and none["replay"]["gib"] == 0
    assert {k: r["layers"] for k, r in none.items() if k != "replay"} == {"attention": 13, "moe": 22, "mamba": 17}
    mamba = activations_by_kind(cfg, ("mamba",), per_sequence=OTHER_GIB_PER_SEQUENCE)
    assert mamba["mamba"]["gib"] * GIB == 17 * 2 * cfg.hidden * 2 * cfg.seq_len
    assert mamba["moe"]["gib"] == none["moe"]["gib"]
    assert mamba["replay"]["gib"] == pytest.approx(none["mamba"]["gib"] / 17)
    full = activations_by_kind(cfg, ("layer",), per_sequence=OTHER_GIB_PER_SEQUENCE)
    assert full["moe"]["gib"] * GIB == 22 * cfg.hidden * 2 * cfg.seq_len
    assert per_sequence_gib(full) < per_sequence_gib(mamba) < OTHER_GIB_PER_SEQUENCE
    scan = activations_by_kind(cfg, ("mamba-scan",), per_sequence=OTHER_GIB_PER_SEQUENCE)
    from nam56r.blocks.mamba3 import Mamba3Mixer
    from nam56r.memory import mamba_scan_extra_per_token
    from nam56r.model import build_model

    mixer = next(m for m in build_model(cfg, device="meta").modules() if isinstance(m, Mamba3Mixer))
    widths = mixer.in_proj.out_features + mixer.out_proj.in_features  # in_proj's output, out_proj's input
    assert mamba_scan_extra_per_token(cfg) == 2 * widths == 2 * (24992 + 8192)  # bf16
    assert scan["mamba"]["gib"] * GIB == 17 * (2 * cfg.hidden * 2 + 2 * widths) * cfg.seq_len
    assert scan["moe"]["gib"] == none["moe"]["gib"] and scan["mamba"]["recomputed"]
    assert per_sequence_gib(mamba) < per_sequence_gib(scan) < OTHER_GIB_PER_SEQUENCE
