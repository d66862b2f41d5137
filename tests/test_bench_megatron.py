"""bench/megatron.py's comparison arithmetic on CPU: the floor is the largest of several perturbed runs, and
each perturbed initial state moves every weight by at most PERTURB, each with its own noise."""

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("megatron")


def _losses(*values):
    return [{"step": i + 1, "loss": v, "grad_norm": 1.0} for i, v in enumerate(values)]


def test_compare_takes_the_largest_floor_and_leaves_unresumed_steps_empty(bench):
    local = _losses(4.0, 3.0, 2.0)
    megatron = _losses(4.0, 3.03, 2.0)
    resumed = [{"step": 3, "loss": 2.002}]
    floors = [_losses(4.0, 3.0, 2.04), _losses(4.0, 2.94, 2.0)]
    rows = bench.compare(local, megatron, resumed, floors)
    assert [r["floor_rel"] for r in rows] == pytest.approx([0.0, 0.02, 0.02])
    assert [r["engine_rel"] for r in rows] == pytest.approx([0.0, 0.01, 0.0])
    assert [r["resume_rel"] for r in rows[:2]] == [None, None] and rows[2]["resume_rel"] == pytest.approx(1e-3)
    assert rows[1]["floors"] == [3.0, 2.94]
    with pytest.raises(ValueError):  # a floor run that stopped early is an error, not a shorter table
        bench.compare(local, megatron, resumed, [_losses(4.0, 3.0)])


def test_initial_states_perturb_each_floor_within_perturb_and_differently(bench, tmp_path, monkeypatch):
    from nam56r.recipes import get_recipe

    monkeypatch.setattr(bench, "packed_rows", lambda *a: None)  # the corpus is not what this test is about
    init, perturbed = bench.initial_states(get_recipe("nam56r-tiny"), tmp_path, floors=2)
    base, first, second = (torch.load(p) for p in (init, *perturbed))
    moved = [k for k, v in base.items() if v.is_floating_point() and v.abs().max() > 0]
    assert moved and len(perturbed) == 2
    for state in (first, second):
        for k in moved:
            rel = ((state[k] - base[k]).abs() / base[k].abs().clamp_min(1e-30))[base[k] != 0]
            assert rel.max() <= bench.PERTURB + 2 * torch.finfo(torch.float32).eps, k  # (1 + u) rounds in fp32
    assert any(not torch.equal(first[k], second[k]) for k in moved)
    assert any(not torch.equal(first[k], base[k]) for k in moved)


def test_bench_runs_are_requested_as_nam_train_would_request_them(bench):
    """The bench's runs go through the composition root: its fast row names the plugins whose backends it
    times, and a float8 row the float8 plugin's option, so activation checks them as `nam train` does."""
    from nam56r.run import resolve
    from nam_core.engine.config import TrainConfig

    train = TrainConfig(engine="megatron", device="cuda", micro_batch_size=2, ep=1)
    spec = {"recipe": "nam56r", "backends": "fast", "ssm": "mimo-scan", "moe": "grouped", "steps": 3,
            "float8": "rowwise", "model": {"seq_len": 2048}}
    run = resolve(bench.request_for(spec, train))
    assert run.max_steps == 3 and run.spec.model.seq_len == 2048 and run.spec.train.micro_batch_size == 2
    assert {"mimo-scan", "grouped-moe", "sparse-mla", "liger", "float8"} <= set(run.spec.plugins)
    assert run.spec.backends["ssm"] == "mimo-scan" and run.spec.options["float8"].linears == "rowwise"
    assert run.lowering is not None and run.lowering.moe_dispatcher == train.moe_dispatcher


def test_te_rows_request_the_te_plugin_and_its_options(bench):
    """``--te``: every row once per entry, the te plugin with its recipe (none: without it); ``--te-experts
    grouped`` adds megatron rows only (TEGroupedMLP is Megatron's)."""
    from types import SimpleNamespace

    from nam56r.run import resolve
    from nam_core.engine.config import TrainConfig

    args = SimpleNamespace(numerics=["fp32-master"], recompute=["none"], engines=["local", "megatron"],
                           float8=["none"], gpus=[1], overlap=["none"], te=["none", "current"],
                           te_experts=["nam", "grouped"])
    runs = bench.throughput_runs(args)
    assert [(r[0], r[6]) for r in runs] == [("local", ("none", "nam")), ("megatron", ("none", "nam")),
                                            ("local", ("current", "nam")), ("megatron", ("current", "nam")),
                                            ("megatron", ("current", "grouped"))]
    train = TrainConfig(engine="megatron", device="cuda", micro_batch_size=2, ep=1)
    spec = {"recipe": "nam56r", "backends": "fast", "steps": 3, "te": "current", "te_experts": "grouped"}
    run = resolve(bench.request_for(spec, train))
    assert "te" in run.spec.plugins and run.spec.options["te"].fp8 == "current"
    assert run.lowering.config_args["fp8_recipe"] == "tensorwise" and run.lowering.config_args["moe_grouped_gemm"]
    assert "te" not in resolve(bench.request_for({**spec, "te": "none"}, train)).spec.plugins
