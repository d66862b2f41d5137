"""nam56r/memory.py: the static part counted exactly, the activations from per-block constants measured under each
recompute choice (nam56r/activations.json, bench/activations.py), the peak by replaying the backward."""

import pytest

from nam56r import memory
from nam56r.memory import (GIB, OUTSIDE_ALLOCATOR_GIB, RECOMPUTED_BY, Constants, Line, Measured, backward_order,
                           backward_peak, choice_for, constants_from, megatron_plan, parameter_split,
                           parameters_by_part, part_counts)
from nam56r.recipes import get_recipe

CHOICES = ("none", "mamba", "mamba-scan", "moe", "attention", "layer")


@pytest.fixture(scope="module")
def cfg():
    return get_recipe("nam56r").model


@pytest.fixture(scope="module")
def split(cfg):
    return parameter_split(cfg)


def test_split_counts_every_parameter_once_and_the_parts_add_up(cfg, split):
    dense, routed = split
    assert dense + routed == pytest.approx(4.73e9, rel=2e-3)
    counts = part_counts(cfg)
    assert counts == {"mamba": 17, "moe": 22, "dsa": 9, "mla": 4, "mtp": 2, "head": 1, "embedding": 1}
    assert routed == counts["moe"] * cfg.num_experts * 3 * cfg.hidden * cfg.moe_ffn_hidden  # gate, up, down
    parts = parameters_by_part(cfg)
    assert (sum(d for d, _ in parts.values()), sum(r for _, r in parts.values())) == split
    assert all(r == 0 for p, (_, r) in parts.items() if p != "moe")
    assert parts["head"][0] == cfg.vocab_size * cfg.hidden + cfg.hidden  # untied head + final norm


def test_static_part_by_hand():
    plan = megatron_plan(800, 200, world=4, ep=2, mbs=3, other_gib=3.5)
    local = 800 + 200 / 2
    assert plan.weights_gib * GIB == pytest.approx(2 * local) and plan.grads_gib * GIB == pytest.approx(4 * local)
    assert plan.optimizer_gib * GIB == pytest.approx(12 * (800 / 4 + 100 / 2))  # experts sharded over world/ep
    assert plan.total_gib == pytest.approx(plan.static_gib + 3.5)
    assert plan.fits(plan.total_gib + OUTSIDE_ALLOCATOR_GIB) and not plan.fits(plan.total_gib + OUTSIDE_ALLOCATOR_GIB - 0.01)
    with pytest.raises(ValueError, match="ep dividing world"):
        megatron_plan(800, 200, world=4, ep=3, mbs=1)
    rows = memory.static_by_part({"moe": (800, 200)}, engine="megatron", numerics="bf16-moments", world=4, ep=2)
    assert rows["moe"]["optimizer_gib"] * GIB == pytest.approx(6 * (800 + 200) / 4)  # int16 remainders, bf16 moments
    rows = memory.static_by_part({"moe": (800, 200)}, engine="local", numerics="fp32-master", dtype_bytes=2)
    assert (rows["moe"]["weights_gib"] * GIB, rows["moe"]["optimizer_gib"] * GIB) == (2000, 12000)


def test_bf16_gradient_buffers_halve_the_gradients_part(tmp_path):
    """train.grad_reduce_in_fp32=false: 2 bytes per parameter of gradients, in the plan, per part, and in the
    dry-run of the megatron engine (the weights and the optimizer unchanged)."""
    from nam_core.engine.config import TrainConfig

    assert memory.grad_bytes(TrainConfig()) == 4 and memory.grad_bytes(TrainConfig(grad_reduce_in_fp32=False)) == 2
    fp32, bf16 = (megatron_plan(800, 200, world=4, ep=2, mbs=1, grad_bytes=b) for b in (4, 2))
    assert bf16.grads_gib * GIB == pytest.approx(2 * (800 + 100)) and bf16.grads_gib == pytest.approx(fp32.grads_gib / 2)
    assert (bf16.weights_gib, bf16.optimizer_gib) == (fp32.weights_gib, fp32.optimizer_gib)
    rows = memory.static_by_part({"moe": (800, 200)}, engine="megatron", numerics="fp32-master", world=4, ep=2,
                                 grad_bytes=2)
    assert rows["moe"]["grads_gib"] * GIB == pytest.approx(2 * 900)


def test_numerics_change_the_optimizer_bytes(split):
    fp32 = megatron_plan(*split, world=8, ep=8, mbs=1)
    moments = megatron_plan(*split, world=8, ep=8, mbs=1, numerics="bf16-moments")
    assert moments.optimizer_gib == pytest.approx(fp32.optimizer_gib * 6 / 12)
    fused = megatron_plan(*split, world=8, ep=8, mbs=1, numerics=memory.FUSED_FP32_MASTER)
    assert fused.optimizer_gib == pytest.approx(fp32.optimizer_gib * 10 / 12)
    local = memory.local_static_gib(1000, 2, "fp32-master")
    assert local["optimizer_gib"] * GIB == pytest.approx(12_000) and local["static_gib"] * GIB == pytest.approx(16_000)
    assert memory.local_static_gib(1000, 2, "stochastic-rounding")["static_gib"] * GIB == pytest.approx(8_000)


def test_line_fits_the_micro_batches():
    assert Line.fit([(4, 400.0), (2, 220.0)]) == Line(40.0, 90.0)
    assert Line.fit([(4, 400.0)]) == Line(0.0, 100.0)  # one micro-batch: through 0
    assert Line(40.0, 90.0).at(8) == 760.0


# --- a hand-computed plan -----------------------------------------------------------------------------------

KEPT = {"mamba": 10, "moe": 20, "dsa": 30, "mla": 40, "mtp": 50, "head": 60, "embedding": 70}
"""Synthetic bytes per sequence each part keeps without recompute; a recomputed part keeps 1."""


def synthetic(extra: dict | None = None, grads: int = 0, shared: int = 0) -> Constants:
    extra = extra or {}
    parts = {}
    for part, kept in KEPT.items():
        for choice in CHOICES:
            k = 1 if choice in RECOMPUTED_BY[part] else kept
            parts[part, choice] = Measured(kept=Line(0.0, k * GIB), backward_extra=Line(0.0, extra.get(part, 0) * GIB),
                                           grad_bytes=grads * GIB,
                                           shared_grad_bytes=shared * GIB if part in ("mtp", "head") else 0)
    return Constants(meta={"gpu": "synthetic", "date": "-"}, parts=parts)


def test_the_activations_sum_the_parts_under_each_choice(cfg):
    c = synthetic()
    none = backward_peak(cfg, (), 2, grads=False, constants=c)
    total = 17 * 10 + 22 * 20 + 9 * 30 + 4 * 40 + 2 * 50 + 60 + 70  # 1270 per sequence
    assert none["activations_gib"] == 2 * total and none["peak_gib"] == 2 * total and none["peak_at"] == "mtp"
    mixed = backward_peak(cfg, ("mamba", "moe"), 2, grads=False, constants=c)
    assert mixed["activations_gib"] == 2 * (total - 17 * 9 - 22 * 19)
    rows = mixed["rows"]
    assert rows["mamba"]["choice"] == "mamba" and rows["moe"]["choice"] == "moe" and rows["dsa"]["choice"] == "none"
    assert rows["moe"]["gib"] == 2 * 22 and rows["moe"]["without_recompute_gib"] == 2 * 22 * 20
    layer = backward_peak(cfg, ("layer",), 1, grads=False, constants=c)
    assert layer["activations_gib"] == 17 + 22 + 9 + 4 + 2 + 60 + 70  # the head and embedding are never recomputed


def test_the_backward_replay_by_hand(cfg):
    """The peak is where kept-but-not-done, gradients made so far and the part's own backward peak add up most:
    with 200 per sequence extra at the head, 1270 - 2 x 50 (the MTP depths done) + 200 = 1370 at the head;
    with gradients of 5 per part (and a shared 100, made once), the embedding, last, sees every other part's."""
    order = backward_order(cfg)
    assert order[:3] == ["mtp", "mtp", "head"] and order[-1] == "embedding" and len(order) == 2 + 1 + 52 + 1
    from nam56r.pattern import KIND, resolve

    resolved = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks).resolved  # AEMEDEME...MMAEME
    assert order[3:-1] == [KIND[s] for s in reversed(resolved)] and order[3] == "moe"
    peak = backward_peak(cfg, (), 1, grads=False, constants=synthetic(extra={"head": 200}))
    assert peak["peak_gib"] == 1370 and peak["peak_at"] == "head"
    c = synthetic(extra={"embedding": 1300}, grads=5, shared=100)
    made = 5 * 55 + 100  # 55 parts before the embedding, the shared gradient once
    assert backward_peak(cfg, (), 1, grads=True, constants=c)["peak_gib"] == 70 + made + 1300
    assert backward_peak(cfg, (), 1, grads=False, constants=c)["peak_gib"] == 70 + 1300  # megatron: static grads


def test_local_plan_by_hand(cfg):
    c = synthetic()
    params = 1_000_000_000
    plan = memory.local_plan(params, 2, numerics="fp32-master", mbs=2, cfg=cfg, kinds=(), constants=c)
    held = params * (2 + 12) / GIB
    assert plan["total_gib"] == pytest.approx(held + 2 * 1270) and plan["peak_at"].startswith("backward")
    tiny = {k: Measured(Line(0, 0), Line(0, 0), 0, 0) for k in c.parts}
    step = memory.local_plan(params, 2, numerics="fp32-master", mbs=1, cfg=cfg, kinds=(),
                             constants=Constants(meta={}, parts=tiny))
    assert step["peak_at"] == "optimizer step" and step["total_gib"] == pytest.approx(held + params * 4 / GIB)


def test_recompute_choices_reach_exactly_their_parts():
    assert {p: choice_for(p, ("mamba", "moe")) for p in KEPT} == {
        "mamba": "mamba", "moe": "moe", "dsa": "none", "mla": "none", "mtp": "none", "head": "none",
        "embedding": "none"}
    assert {p: choice_for(p, ("layer",)) for p in KEPT} == {
        "mamba": "layer", "moe": "layer", "dsa": "layer", "mla": "layer", "mtp": "layer", "head": "none",
        "embedding": "none"}
    assert choice_for("mamba", ("mamba-scan", "attention")) == "mamba-scan"
    assert choice_for("mtp", ("mamba-scan", "attention")) == "attention"


def test_constants_refuse_cpu_rows_and_other_shapes():
    row = {"part": "mamba", "choice": "none", "batch": 2, "kept_bytes": 1, "backward_extra_bytes": 0,
           "grad_bytes": 0, "shared_grad_bytes": 0}
    good = {"meter": "torch.cuda.memory_allocated", "shape": dict(memory.MEASURED_SHAPE)}
    assert constants_from({"meta": good, "rows": [row]}).get("mamba", "none").kept == Line(0.0, 0.5)
    with pytest.raises(ValueError, match="on a GPU"):
        constants_from({"meta": {**good, "meter": "saved tensors (a lower count)"}, "rows": [row]})
    with pytest.raises(ValueError, match="measured at"):
        constants_from({"meta": {**good, "shape": {"hidden": 64}}, "rows": [row]})
    with pytest.raises(KeyError, match="no row for part 'moe'"):
        constants_from({"meta": good, "rows": [row]}).get("moe", "none")


def test_a_missing_or_cpu_constants_file_is_one_error_with_the_command(tmp_path):
    from nam_core.errors import NamError

    with pytest.raises(NamError, match="found no such file") as e:
        memory.load_constants(tmp_path / "activations.json")
    assert "python bench/activations.py --batch 4" in str(e.value)
    cpu = tmp_path / "cpu.json"
    cpu.write_text('{"meta": {"meter": "saved tensors (a lower count)"}, "rows": []}')
    with pytest.raises(NamError, match="must be measured on a GPU"):
        memory.load_constants(cpu)


# --- the checked-in constants ---------------------------------------------------------------------------------


def test_the_checked_in_constants_are_from_a_gpu_and_cover_every_part_and_choice():
    c = memory.load_constants()
    assert c.meta["gpu"].startswith("NVIDIA") and c.meta["shape"] == memory.MEASURED_SHAPE
    assert c.meta["dtype"] == "bfloat16" and 4 in c.meta["batches"]
    assert set(c.parts) == {(p, ch) for p in memory.PARTS for ch in CHOICES}


@pytest.mark.parametrize("part", memory.PARTS)
def test_measured_recompute_lowers_exactly_the_parts_it_reaches(part):
    """On the GPU's numbers: a choice that reaches the part keeps less than no recompute (at MBS 4, by more than
    1%); any other choice keeps the same within 1% (the allocator's rounding)."""
    c = memory.load_constants()
    none = c.get(part, "none").kept.at(4)
    for choice in CHOICES[1:]:
        kept = c.get(part, choice).kept.at(4)
        if choice in RECOMPUTED_BY[part]:
            assert kept < 0.99 * none, (part, choice, kept, none)
        else:
            assert kept == pytest.approx(none, rel=0.01), (part, choice, kept, none)


def test_the_plan_is_within_ten_percent_of_every_measured_peak(load_bench):
    """bench/memory_plan.py's table (bench/results/plan_vs_measured.json): the plan against every recorded peak of
    full NAM56R on an H200, both engines, each numerics and recompute measured; the issue's target is 10%."""
    rows = load_bench("memory_plan").table()
    measured = [r for r in rows if r["measured_gib"] is not None]
    assert len(measured) >= 15 and {r["engine"] for r in measured} == {"local", "megatron"}
    for r in measured:
        assert abs(r["error"]) <= 0.10, r
        assert r["fits"]  # every one of them ran
    scan = next(r for r in rows if r["recompute"] == ["mamba-scan"])
    assert scan["measured_gib"] is not None and scan["fits"]  # MBS 4 at fp32-master: 129.5 GiB, it fits


def test_fused_master_weights_keep_the_masters_as_remainders():
    """train.fused_master_weights (fp32-master on TE's FusedAdam): the plan's key, 2 bytes per parameter fewer
    than Megatron's own fp32 masters in the optimizer part of the dry-run; other numerics keep their key."""
    from nam_core.engine.config import TrainConfig

    bf16 = TrainConfig(dtype="bfloat16", device="cuda")
    assert memory.megatron_numerics(bf16) == "fp32-master"
    assert memory.megatron_numerics(bf16.replace(fused_master_weights=True)) == memory.FUSED_FP32_MASTER
    assert memory.megatron_numerics(bf16.replace(optimizer_numerics="bf16-moments")) == "bf16-moments"
    rows = {fused: memory.static_by_part({"moe": (800, 200)}, engine="megatron", world=1, ep=1,
                                         numerics=memory.megatron_numerics(bf16.replace(fused_master_weights=fused)))
            for fused in (False, True)}
    assert (rows[False]["moe"]["optimizer_gib"] - rows[True]["moe"]["optimizer_gib"]) * GIB == pytest.approx(2 * 1000)
