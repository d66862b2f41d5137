"""The Megatron lowering as plain data: pattern, slot classes, argument checks, JSON, and the CLI."""

import importlib
import json

import pytest

from nam56r.megatron import SYMBOL, check_lowering, lower, megatron_args
from nam56r.pattern import resolve
from nam56r.recipes import get_recipe
from nam_cli.main import run
from nam_core.engine.megatron.schedule import PipelineSchedule
from nam_core.errors import ConfigError


@pytest.fixture(scope="module")
def cfg():
    return get_recipe("nam56r").model


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_pattern_has_the_plan_counts_and_order(cfg):
    lowering = lower(cfg)
    plan = resolve(cfg.pattern, cfg.num_layers, cfg.mla_attention_ranks)
    main, *mtp = lowering.hybrid_layer_pattern.split("/")
    assert main == lowering.main_pattern == "".join(SYMBOL[l.symbol] for l in plan.layers)
    assert len(main) == 52 == lowering.config_args["num_layers"]
    counts = {s: main.count(s) for s in "+DEM"}
    assert counts == {"+": 4, "D": 9, "E": 22, "M": 17}
    assert mtp == ["+-", "+-"] and lowering.config_args["mtp_num_layers"] == 2
    assert "*" not in lowering.hybrid_layer_pattern  # '*' cannot be mixed with D or '+' (reference 1.3)
    assert [l["dsa_rank"] for l in lowering.layers if l["megatron"] == "D"] == list(range(9))


def test_config_args_carry_the_nam56r_dims(cfg):
    a = lower(cfg, tp=2, ep=4).config_args
    assert (a["hidden_size"], a["num_attention_heads"], a["num_moe_experts"], a["moe_router_topk"]) == (4096, 32, 16, 4)
    assert (a["moe_ffn_hidden_size"], a["moe_shared_expert_intermediate_size"]) == (160, 576)
    assert (a["qk_head_dim"], a["qk_pos_emb_head_dim"], a["v_head_dim"]) == (64, 64, 128)  # no-RoPE part, not 128
    assert (a["tensor_model_parallel_size"], a["expert_model_parallel_size"]) == (2, 4)


def test_every_slot_class_imports(cfg):
    """No placeholder: every nam class must exist here; Megatron classes are checked where this megatron has them."""
    from importlib.metadata import version

    from packaging.version import Version

    lowering = lower(cfg)
    nam = [s for s in lowering.slots if s.provider == "nam"]
    assert {s.module for s in nam} == {"nam56r.blocks.mamba3.Mamba3Mixer", "nam56r.blocks.dsa.DSA",
                                       "nam56r.blocks.mla.MLA", "nam56r.blocks.ngram_hash.NgramHashEmbedding",
                                       "nam56r.backends.MoEExperts"}  # the experts module in Megatron's MoELayer
    for slot in lowering.slots:
        if slot.nam_block:
            assert isinstance(_import(slot.nam_block), type), slot.nam_block
        if slot.provider == "nam":
            assert isinstance(_import(slot.module), type), slot.module
    # Every Megatron class named here also exists in 0.16.1 (0.19 keeps them or re-exports them, reference 1.1).
    assert Version(version("megatron-core")) >= Version("0.16.1")
    for slot in lowering.slots:
        if slot.provider == "megatron":
            assert isinstance(_import(slot.module), type), slot.module
    moe = next(s for s in lowering.slots if s.path == "moe_layer.submodules.mlp")
    assert moe.kwargs["moe_token_dispatcher_type"] == lowering.moe_dispatcher == "alltoall"


def test_ep_must_divide_the_experts(cfg):
    with pytest.raises(ConfigError, match=r"ep=3 must divide num_experts, found num_experts=16") as e:
        lower(cfg, ep=3)
    assert "divisors of num_experts=16" in e.value.hint


def test_tp_must_divide_attention_and_mamba_heads(cfg):
    with pytest.raises(ConfigError, match=r"tp=3 must divide attn_heads"):
        lower(cfg, tp=3)
    with pytest.raises(ConfigError, match=r"tp=16 must divide mamba_ngroups, found mamba_ngroups=8"):
        lower(cfg, tp=16)  # 32 heads and 128 Mamba heads split by 16; 8 B/C groups do not
    assert any(g.what == "tensor parallelism in nam slots" and g.status == "open" for g in lower(cfg, tp=2).gaps)


def test_pp_splits_evenly_or_is_refused(cfg):
    lowering = lower(cfg, pp=4)
    main = lowering.hybrid_layer_pattern.split("/")[0]
    assert [len(seg) for seg in main.split("|")] == [13, 13, 13, 13]
    assert main.replace("|", "") == lower(cfg).main_pattern
    assert [l["pp_stage"] for l in lowering.layers][12:14] == [0, 1]
    with pytest.raises(ConfigError, match=r"pp=5 must divide num_layers, found num_layers=52"):
        lower(cfg, pp=5)


class Reversed(PipelineSchedule):
    """A toy registered schedule: two chunks per rank, the second half of the stages in reverse (a V)."""

    name = "reversed"
    chunks_per_rank = 2

    def stage_of(self, rank, chunk, pp):
        return rank if chunk == 0 else 2 * pp - 1 - rank


def test_a_schedule_s_stages_drive_the_lowering(cfg):
    """The lowering lays out whatever stages the schedule names (the core names no schedule): pp=2 x 2 chunks
    of 13 layers, rank 0 holding stages 0 and 3."""
    lowering = lower(cfg, pp=2, schedule=Reversed())
    assert (lowering.schedule, lowering.chunks, lowering.stage_map) == ("reversed", 2, ((0, 3), (1, 2)))
    assert [len(seg) for seg in lowering.hybrid_layer_pattern.split("/")[0].split("|")] == [13] * 4
    stages = {(l["pp_stage"], l["pp_rank"], l["chunk"]) for l in lowering.layers}
    assert stages == {(0, 0, 0), (1, 1, 0), (2, 1, 1), (3, 0, 1)}
    assert lower(cfg, pp=2, schedule="1f1b").schedule == "megatron" and lower(cfg, pp=2).megatron_order

    class Broken(Reversed):
        def stage_of(self, rank, chunk, pp):
            return rank

    with pytest.raises(ConfigError, match="not to each of 0..3 once"):
        lower(cfg, pp=2, schedule=Broken())
    with pytest.raises(ConfigError, match=r"pipeline stages=8 must divide num_layers, found num_layers=52"):
        lower(cfg, pp=4, schedule=Reversed())


def test_the_moe_backend_fills_the_experts_slot_inside_megatrons_moe_layer(cfg):
    slot = next(s for s in lower(cfg.replace(moe_backend="grouped")).slots if s.path.endswith(".experts"))
    assert slot.path == "moe_layer.submodules.mlp.submodules.experts" and slot.provider == "nam"
    assert slot.backends == {"moe": "grouped"} and slot.adapter == "nam56r.megatron.moe.ExpertsSlot"


def test_cuda_graphs_note_at_pp1(cfg):
    lowering = lower(cfg)
    assert lowering.cuda_graphs is False
    assert any("CUDA graphs off" in n and "pp == 1" in n for n in lowering.notes)


def test_gaps_name_what_megatron_lacks(cfg):
    gaps = {g.what: g for g in lower(cfg).gaps}
    for what in ("Mamba-3 mixer", "final norm", "DSA indexer loss scale", "DSA at NAM56R's MLA dims", "CE head"):
        assert what in gaps
    assert gaps["Mamba-3 mixer"].status == "covered"
    assert all(g.status in ("covered", "open") for g in gaps.values())


def test_to_dict_round_trips_through_json(cfg):
    d = lower(cfg, tp=2, pp=2, ep=4).to_dict()
    assert json.loads(json.dumps(d)) == d


def test_megatron_args_flags(cfg):
    flags = megatron_args(lower(cfg, ep=4))
    pairs = dict(zip(flags, flags[1:]))
    assert pairs["--hybrid-layer-pattern"] == lower(cfg).hybrid_layer_pattern
    assert pairs["--num-experts"] == "16" and pairs["--moe-router-topk"] == "4"
    assert pairs["--expert-model-parallel-size"] == "4" and pairs["--mtp-num-layers"] == "2"
    for flag in ("--bf16", "--multi-latent-attention", "--disable-bias-linear", "--untie-embeddings-and-output-weights"):
        assert flag in flags
    assert not any(f.startswith("--activation-func") or f.startswith("--params-dtype") for f in flags)


def test_cli_prints_the_lowering_as_json(capsys):
    assert run(["recipe", "show", "nam56r", "--megatron-args", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["hybrid_layer_pattern"] == lower(get_recipe("nam56r").model).hybrid_layer_pattern
    assert "--hybrid-layer-pattern" in d["flags"] and d["gaps"] and d["slots"]


@pytest.mark.parametrize("tp", [1, 2])
def test_recipe_show_reports_the_gaps_the_build_covers(capsys, tp):
    """`nam recipe show nam56r --megatron-args` says "covered" for a gap exactly when the build has the code
    that covers it (``covered_by`` resolves), and the gaps it says are open are exactly the ones the build
    refuses (``check_lowering``): none at tp 1, tensor parallelism at tp 2."""
    assert run(["recipe", "show", "nam56r", "--megatron-args", "--json", "--tp", str(tp)]) == 0
    gaps = json.loads(capsys.readouterr().out)["gaps"]
    for gap in gaps:
        if gap["covered_by"] is not None:
            module, _, attr = gap["covered_by"].partition(":")
            target = importlib.import_module(module)
            for part in attr.split("."):
                target = getattr(target, part)  # the covering code exists (AttributeError otherwise)
        assert gap["status"] == ("covered" if gap["covered_by"] else "open"), gap
    shown_open = {g["what"] for g in gaps if g["status"] == "open"}
    lowering = lower(get_recipe("nam56r").model, tp=tp)
    if shown_open:
        with pytest.raises(ConfigError) as e:
            check_lowering(lowering, registered_schedules={})
        refused = {g.what for g in lowering.open_gaps}
        assert refused == shown_open and all(what in str(e.value) for what in refused)
    else:
        check_lowering(lowering, registered_schedules={})
    assert shown_open == (set() if tp == 1 else {"tensor parallelism in nam slots"})


def test_cli_refuses_ep3_with_exit_2(capsys):
    assert run(["recipe", "show", "nam56r", "--megatron-args", "--ep", "3"]) == 2
    assert "ep=3 must divide num_experts" in capsys.readouterr().err


def test_dispatcher_is_the_run_s_choice_and_flex_names_deepep():
    cfg = get_recipe("nam56r").model
    assert lower(cfg).config_args["moe_token_dispatcher_type"] == "alltoall"
    assert "moe_flex_dispatcher_backend" not in lower(cfg).config_args
    flex = lower(cfg, ep=4, dispatcher="flex")
    assert (flex.moe_dispatcher, flex.config_args["moe_token_dispatcher_type"],
            flex.config_args["moe_flex_dispatcher_backend"]) == ("flex", "flex", "deepep")
    with pytest.raises(ConfigError, match="MoE dispatcher 'deepep': expected one of alltoall, flex"):
        lower(cfg, dispatcher="deepep")


@pytest.mark.parametrize("kinds, config, slots", [
    ((), {}, ()),
    (("layer",), {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, ()),
    (("mamba", "moe"), {"recompute_granularity": "selective", "recompute_modules": ["moe"]}, ("mamba",)),
    (("mamba", "attention"), {}, ("mamba", "attention")),
    (("mamba-scan", "moe"), {"recompute_granularity": "selective", "recompute_modules": ["moe"]}, ("mamba-scan",)),
])
def test_recompute_lowers_to_megatrons_own_where_it_has_one(cfg, kinds, config, slots):
    """``layer`` and ``moe``: Megatron's full and selective-moe recompute; Mamba and attention: nam's slots."""
    lowering = lower(cfg, recompute=kinds)
    got = {k: v for k, v in lowering.config_args.items() if k.startswith("recompute")}
    assert got == config and lowering.recompute_in_slots == slots
    if "recompute_modules" in config:
        flags = megatron_args(lowering)
        assert flags[flags.index("--recompute-modules") + 1] == "moe"
        assert json.loads(json.dumps(lowering.to_dict()))["config_args"]["recompute_modules"] == ["moe"]
