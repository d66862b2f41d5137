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
    assert {"mimo-scan", "grouped-moe", "sparse-mla", "hopper-ce", "float8"} <= set(run.spec.plugins)
    assert run.spec.backends["ssm"] == "mimo-scan" and run.spec.options["float8"].linears == "rowwise"
    assert run.lowering is not None and run.lowering.moe_dispatcher == train.moe_dispatcher


def test_throughput_train_set_carries_model_fields_to_every_run(bench):
    """``throughput --train-set compile_glue=true``: a model field or a recipe plugin's option set there reaches
    each run's config (the train fields go through the train dict), so the full model's before/after is one flag."""
    from nam56r.recipes import apply_overrides, get_recipe
    from nam56r.run import resolve

    base = get_recipe("nam56r")
    recipe = apply_overrides(base, ["compile_glue=true", "train.lr=1e-4", "mamba-ssm.group_sums=fused"],
                             plugin_names=base.plugins)
    changed = bench.model_changes(base.model, recipe.model)
    assert changed == {"compile_glue": True}
    spec = {"recipe": "nam56r", "backends": "fast", "steps": 3, "model": {**changed, "num_layers": 52}}
    train = recipe.train.replace(engine="megatron", device="cuda", micro_batch_size=2)
    run = resolve(bench.request_for(spec, train))
    assert run.spec.model.compile_glue is True and base.model.compile_glue is False
    assert run.spec.options["mamba-ssm"].group_sums == "fused" and run.spec.train.lr == 1e-4


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


def test_ce_rows_request_the_head_s_plugin_and_its_options(bench):
    """``throughput --ce liger`` requests the liger plugin and its head in place of the recipe's hopper-ce;
    ``--train-set hopper-ce.gradients=backward`` reaches the head the run builds."""
    from nam56r.recipes import apply_overrides, get_recipe
    from nam56r.run import resolve

    base = get_recipe("nam56r")
    recipe = apply_overrides(base, ["hopper-ce.gradients=backward"], plugin_names=[*base.plugins, "liger"])
    train = recipe.train.replace(engine="megatron", device="cuda", micro_batch_size=2)
    spec = {"recipe": "nam56r", "backends": "fast", "steps": 3}
    run = resolve(bench.request_for(spec, train))
    assert "hopper-ce" in run.spec.plugins and run.spec.model.ce_backend == "hopper-ce"
    assert run.spec.options["hopper-ce"].gradients == "backward"
    liger = resolve(bench.request_for({**spec, "ce": "liger"}, base.train.replace(engine="megatron", device="cuda")))
    assert "liger" in liger.spec.plugins and liger.spec.model.ce_backend == "liger"


def test_a_sharded_rank_keeps_megatrons_buffers_and_steps_its_shard_as_adamw(bench):
    """``ShardedRank`` on a small bf16 model with two routed-expert-named matrices: gradients land in the fp32
    buffer (equal to the bf16 gradients, upcast) and the bf16 ones are freed; the shard is the first
    ceil(dense / world) dense and ceil(routed / (world / ep)) expert elements; a step moves exactly the
    shard's elements, as torch's AdamW on their fp32 copies would (tolerance 0), and the rest stay as they were."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, bias=False)
            self.w_gate_up = torch.nn.Parameter(torch.randn(2, 6, 8))
            self.w_down = torch.nn.Parameter(torch.randn(2, 8, 3))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mixer = Block()
    model = model.bfloat16()
    before = torch.cat([p.detach().flatten().float() for p in (model.layers[0].mixer.proj.weight,
                                                               model.layers[0].mixer.w_gate_up,
                                                               model.layers[0].mixer.w_down)])
    rank = bench.ShardedRank(model, world=4, ep=2)
    assert (rank.dense, rank.routed) == (64, 96 + 48) and rank.ranges == [(0, 16), (64, 64 + 72)]
    assert rank.shard_elements() == 16 + 72 and rank.grads.dtype == torch.float32
    mixer = model.layers[0].mixer
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    loss = (mixer.proj(x).float().square().sum() + mixer.w_gate_up.float().sum() * 0.5
            + mixer.w_down.float().square().sum())
    loss.backward()
    assert all(p.grad is None for p in model.parameters())  # added into the fp32 buffer and freed
    expected = torch.cat([((x.float().t() @ (2 * mixer.proj(x).float())).t().bfloat16().float()).flatten(),
                          torch.full((96,), 0.5), (2 * mixer.w_down.detach().float()).flatten()])
    assert torch.equal(rank.grads[64:], expected[64:])
    assert torch.allclose(rank.grads[:64], expected[:64], rtol=1e-2, atol=1e-2)  # bf16 GEMM's own rounding
    grads = rank.grads.clone()
    masters = [torch.nn.Parameter(before[a:b].clone()) for a, b in rank.ranges]
    reference = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.1)
    for m, (a, b) in zip(masters, rank.ranges):
        m.grad = grads[a:b]
    reference.step()
    rank.step()
    after = rank.params.float()
    for m, (a, b) in zip(masters, rank.ranges):
        assert torch.equal(after[a:b], m.detach().bfloat16().float())
    outside = torch.ones_like(after, dtype=torch.bool)
    for a, b in rank.ranges:
        outside[a:b] = False
    assert torch.equal(after[outside], before[outside]) and not torch.equal(after, before)
    assert rank.grads.abs().sum() == 0  # zeroed for the next step


@pytest.mark.slow
def test_per_gpu_memory_builds_one_ranks_shapes_and_trains(bench):
    """nam56r-tiny (reference backends, CPU, rows of 32) at one rank's shapes of 8 GPUs at EP 8: 2 experts per
    MoE layer, the static parts the plan counts (within the few fp32 parameters the plan counts as bf16), a
    shard of the plan's size, and two steps that train."""
    from nam56r.memory import GIB
    from nam56r.recipes import get_recipe

    recipe = get_recipe("nam56r-tiny")
    train = recipe.train.replace(micro_batch_size=1, dtype="bfloat16", recompute=("mamba", "moe"), device="cpu",
                                 checkpoint_every=0, total_steps=2, warmup_steps=1)
    spec = {"recipe": recipe.name, "model": {"seq_len": 32}, "backends": "reference"}
    result = bench.per_gpu_memory(spec, train, world=8, ep=8, steps=2, say=lambda line: None)
    plan, got = result["plan"], result["measured"]
    assert got["experts_per_layer"] == 2 and got["peak_gib"] is None and result["activations_by_kind"] is None
    for part in ("weights_gib", "grads_gib", "optimizer_gib"):
        assert got[part] == pytest.approx(plan[part], rel=0.02), part
    assert got["optimizer_gib"] == 12 * got["shard_elements"] / GIB
    assert all(torch.isfinite(torch.tensor(got["losses"]))) and got["losses"][1] != got["losses"][0]


def test_scan_in_pieces_splits_the_per_sequence_arguments_only(bench):
    """Batch 5 in pieces of 2: three calls on sequences [0:2], [2:4], [4:5] of q, k, v, adt, dt, trap, angles and
    z, the biases, D and the MIMO projections whole; the results concatenated in order."""
    b, l, h = 5, 3, 2
    per_seq = {0: (b, l, 4, 1, 8), 1: (b, l, 4, 1, 8), 2: (b, l, h, 6), 3: (b, h, l), 4: (b, h, l), 5: (b, h, l),
               8: (b, l, h, 4), 10: (b, l, h, 6)}
    whole = {6: (h, 4, 8), 7: (h, 4, 8), 9: (h,), 11: (h, 4, 6), 12: (h, 4, 6), 13: (h, 4, 6)}
    args = [torch.randn(per_seq.get(i) or whole[i]) for i in range(14)]
    seen = []

    def scan(*a, chunk_size):
        seen.append([tuple(t.shape) for t in a])
        return a[2] * 2 + a[10] + a[9].sum()

    out = bench.ScanInPieces(scan, 2)(*args, chunk_size=16)
    assert torch.equal(out, scan(*args, chunk_size=16)) and len(seen) == 4
    assert [s[2][0] for s in seen[:3]] == [2, 2, 1] and all(s[i][0] == n for s, n in zip(seen, (2, 2, 1))
                                                             for i in per_seq)
    assert all(s[i] == whole[i] for s in seen[:3] for i in whole)


def test_recompute_cost_is_the_step_time_over_the_matching_none_row(bench):
    row = lambda recompute, ms, numerics="fp32-master", mbs=2: {  # noqa: E731
        "engine": "local", "gpus": 1, "overlap": "none", "numerics": numerics, "mbs": mbs, "recompute": recompute,
        "step_ms": ms}
    rows = [row("none", 900.0), row("mamba", 990.0)]
    assert bench.recompute_cost(rows) == 90.0
    assert bench.recompute_cost(rows[:1]) is None  # none itself
    assert bench.recompute_cost([row("none", 900.0), row("moe", 950.0, numerics="bf16")]) is None  # no matching none
    assert bench.recompute_cost([row("none", 900.0, mbs=4), row("none", 500.0), row("layer", 640.0)]) == 140.0
