"""NAM56R as Megatron-Core modules (nam56r/megatron/), the CPU-checkable half: the gaps it refuses, the
nam -> Megatron weight map, the slot adapters, and (with megatron-core >= 0.19 importable) the config and spec
it builds from the lowering and the stage-choice patch. Training through them runs on the GPU hosts
(tests/test_megatron_engine_gpu.py) and over gloo (tests/test_megatron_engine_gloo.py)."""

import pytest
import torch

from nam56r.megatron import check_lowering, lower, model as mm, patches, slots, spec, weights
from nam56r.model import Backends, build_model
from nam56r.recipes import get_recipe
from nam_core.engine import megatron as engine
from nam_core.errors import ConfigError, NamError

needs_019 = pytest.mark.skipif((engine.megatron_version() or (0,)) < engine.MIN_MEGATRON,
                               reason="needs megatron-core >= 0.19 importable (CI has 0.16.1)")


@pytest.fixture(scope="module")
def cfg():
    return get_recipe("nam56r").model


@pytest.fixture(scope="module")
def tiny():
    return get_recipe("nam56r-tiny").model


@pytest.fixture(scope="module")
def tiny_state(tiny):
    torch.manual_seed(0)
    return build_model(tiny).state_dict()


def _kinds(lowering):
    return tuple(weights.KIND[layer["nam"]] for layer in lowering.layers)


# --- gaps ------------------------------------------------------------------------------------------------


def test_open_gap_tensor_parallel_is_refused(cfg):
    with pytest.raises(ConfigError, match=r"cannot close these gaps of the lowering: tensor parallelism"):
        check_lowering(lower(cfg, tp=2), registered_schedules={})


def test_every_gap_at_the_default_layout_is_covered_by_the_build(cfg):
    """One place decides gap status (the lowering's covered_by): the build refuses nothing at tp 1."""
    assert lower(cfg).open_gaps == () and lower(cfg, ep=4).open_gaps == ()
    check_lowering(lower(cfg, ep=4), registered_schedules={})


def test_provider_reports_the_lowered_layout(cfg):
    model = mm.NamMegatronModel(cfg, Backends.reference(), lower(cfg, pp=2, ep=4), seed=0)
    assert model.parallel == {"tp": 1, "pp": 2, "ep": 4}
    assert (model.seq_len, model.moe_aux_loss_coeff) == (cfg.seq_len, cfg.moe_aux_loss_coeff)


# --- weights ---------------------------------------------------------------------------------------------


def test_weight_map_keeps_every_value_once(tiny, tiny_state):
    lowering = lower(tiny)
    out = weights.nam_state_to_megatron(tiny_state, _kinds(lowering))
    assert sum(v.numel() for v in out.values()) == sum(v.numel() for v in tiny_state.values())
    moe = [l["index"] for l in lowering.layers if l["nam"] == "E"]
    # Experts stay stacked (nam56r.megatron.moe.ExpertsSlot): one key per nam tensor.
    assert len(out) == len(tiny_state) and moe
    i = moe[0]
    assert torch.equal(out[f"decoder.layers.{i}.mlp.experts.w_gate_up"], tiny_state[f"layers.{i}.mixer.w_gate_up"])
    assert torch.equal(out[f"decoder.layers.{i}.mlp.shared_experts.linear_fc2.weight"],
                       tiny_state[f"layers.{i}.mixer.shared.w_down.weight"])
    assert torch.equal(out["output_layer.weight"], tiny_state["head"])
    mamba = next(l["index"] for l in lowering.layers if l["nam"] == "M")
    assert torch.equal(out[f"decoder.layers.{mamba}.mixer.block.D"], tiny_state[f"layers.{mamba}.mixer.D"])
    assert torch.equal(out[f"decoder.layers.{mamba}.norm.weight"], tiny_state[f"layers.{mamba}.norm.weight"])


def test_weight_map_swaps_the_mtp_projection_halves(tiny, tiny_state):
    """nam projects cat(norm_h(h), norm_e(e)), Megatron cat(enorm(e), hnorm(h)): same product, halves swapped."""
    out = weights.nam_state_to_megatron(tiny_state, _kinds(lower(tiny)))
    w_nam, w_meg = tiny_state["mtp.1.eh_proj.weight"], out["mtp.layers.1.eh_proj.weight"]
    h, e = torch.randn(3, tiny.hidden), torch.randn(3, tiny.hidden)
    torch.testing.assert_close(torch.cat([e, h], -1) @ w_meg.T, torch.cat([h, e], -1) @ w_nam.T)
    assert not torch.equal(w_meg, w_nam)
    assert torch.equal(out["mtp.layers.0.mtp_model_layer.layers.1.mlp.linear_fc1.weight"],
                       tiny_state["mtp.0.mlp.w_gate_up.weight"])
    assert torch.equal(out["mtp_norms.1.weight"], tiny_state["mtp.1.final_norm.weight"])


def test_weight_map_splits_experts_over_ep_ranks(tiny, tiny_state):
    kinds = _kinds(lower(tiny))
    i = kinds.index("moe")
    seen = []
    for rank in range(4):
        out = weights.nam_state_to_megatron(tiny_state, kinds, ep_rank=rank, ep_size=4)
        local = {k: v for k, v in out.items() if k.startswith(f"decoder.layers.{i}.mlp.experts.")}
        assert sorted(local) == [f"decoder.layers.{i}.mlp.experts.{w}" for w in ("w_down", "w_gate_up")]
        per_rank = tiny.num_experts // 4
        w = local[f"decoder.layers.{i}.mlp.experts.w_down"]
        assert w.shape[0] == per_rank
        for j in range(per_rank):
            assert torch.equal(w[j], tiny_state[f"layers.{i}.mixer.w_down"][rank * per_rank + j])
            seen.append(rank * per_rank + j)
    assert sorted(seen) == list(range(tiny.num_experts))


def test_weight_map_splits_pipeline_stages(tiny, tiny_state):
    kinds = _kinds(lower(tiny))
    first = weights.nam_state_to_megatron(tiny_state, kinds, first=0, stop=26, post_process=False,
                                         mtp_process=False)
    last = weights.nam_state_to_megatron(tiny_state, kinds, first=26, stop=52, pre_process=False)
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" in last  # MTP's copy
    assert not any(k.startswith(("ngram.", "structure.")) for k in last)
    assert not any(k.startswith(("mtp", "final_norm", "output_layer")) for k in first)
    assert torch.equal(last["decoder.layers.0.norm.weight" if kinds[26] == "mamba" else
                            "decoder.layers.0.input_layernorm.weight" if kinds[26] in ("mla", "dsa") else
                            "decoder.layers.0.pre_mlp_layernorm.weight"], tiny_state["layers.26.norm.weight"])
    layer_keys = [k for k in tiny_state if k.startswith("layers.")]
    mapped = [k for k in first if k.startswith("decoder.")] + [k for k in last if k.startswith("decoder.")]
    assert len(mapped) == len(layer_keys)


def test_weight_map_refuses_unknown_keys(tiny, tiny_state):
    with pytest.raises(NamError, match=r"nam parameter 'lora.A' has no place"):
        weights.nam_state_to_megatron({"lora.A": torch.zeros(1)}, _kinds(lower(tiny)))
    with pytest.raises(NamError, match=r"MoE parameter 'mixer.bias'"):
        weights.nam_state_to_megatron({"layers.2.mixer.bias": torch.zeros(1)}, ("mamba", "mla", "moe"))
    with pytest.raises(ConfigError, match=r"MTP depth pattern '\+\*'"):
        weights.nam_state_to_megatron(tiny_state, _kinds(lower(tiny)), mtp_pattern="+*")


def test_weight_map_read_back_gives_nams_state_bit_for_bit(tiny, tiny_state):
    """``megatron_state_to_nam`` (nam export of a megatron checkpoint, whose tensors are whole) inverts the map:
    every nam tensor back under its name, bit for bit, the MTP projection's halves swapped back."""
    megatron = weights.nam_state_to_megatron(tiny_state, _kinds(lower(tiny)))
    back = weights.megatron_state_to_nam(megatron, tiny)
    assert back.keys() == tiny_state.keys()
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tiny_state.items())


def test_weight_map_read_back_refuses_a_missing_or_an_extra_tensor(tiny, tiny_state):
    megatron = weights.nam_state_to_megatron(tiny_state, _kinds(lower(tiny)))
    with pytest.raises(NamError, match=r"has no 'output_layer.weight' \(nam's 'head'\)"):
        weights.megatron_state_to_nam({k: v for k, v in megatron.items() if k != "output_layer.weight"}, tiny)
    grouped = {k: v for k, v in megatron.items() if not k.endswith("experts.w_down")}
    with pytest.raises(NamError, match=r"has no 'decoder.layers.\d+.mlp.experts.w_down'") as e:
        weights.megatron_state_to_nam(grouped, tiny)
    assert "grouped experts" in e.value.hint
    with pytest.raises(NamError, match=r"tensors nam56r has no place for: \['lora.A'\]"):
        weights.megatron_state_to_nam({**megatron, "lora.A": torch.zeros(1), "head._extra_state/shard_0_1": None},
                                      tiny)


# --- adapters (no megatron needed for the Mamba slot) -----------------------------------------------------


def test_mamba_slot_is_the_mixer_in_megatron_layout(tiny):
    backends = Backends.reference()
    shared = slots.Slots(tiny, backends, {})
    torch.manual_seed(0)
    slot = slots.MambaSlot(None, d_model=tiny.hidden, layer_number=3, pg_collection=None, nam=shared)
    x = torch.randn(tiny.seq_len, 2, tiny.hidden)  # [s, b, h]
    out, bias = slot(x)
    assert bias is None and out.shape == x.shape
    torch.testing.assert_close(out, slot.block(x.transpose(0, 1)).transpose(0, 1), rtol=0, atol=0)
    with pytest.raises(NamError, match="no packed"):
        slot(x, packed_seq_params=object())
    assert not slot.block.recompute_scan


def test_mamba_slot_under_mamba_scan_checkpoints_between_the_projections_bit_exactly(tiny):
    """``train.recompute=mamba-scan`` in the megatron engine: the slot's mixer marks itself; output and every
    gradient equal the unmarked slot's (tolerance 0)."""
    runs = []
    for recompute in ((), ("mamba-scan",)):
        torch.manual_seed(0)
        slot = slots.MambaSlot(None, d_model=tiny.hidden, layer_number=3, pg_collection=None,
                               nam=slots.Slots(tiny, Backends.reference(), {}, recompute=recompute))
        assert slot.block.recompute_scan == bool(recompute)
        x = torch.randn(tiny.seq_len, 2, tiny.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out, _ = slot(x)
        out.square().sum().backward()
        runs.append([out.detach(), x.grad, *(p.grad for p in slot.parameters())])
    assert len(runs[1]) == len(runs[0]) > 5 and all(torch.equal(a, b) for a, b in zip(*runs))


def test_attention_slot_attaches_the_indexer_loss(tiny):
    """The indexer learns only from its KL (DSA detaches its inputs); the adapter must carry that loss to
    backward and log it, or DSA's indexer never trains under Megatron."""
    dsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
    from nam56r.state import ForwardState

    dsa.DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    shared = slots.Slots(tiny, Backends.reference(), {5: 0})
    torch.manual_seed(0)
    slot = slots.AttentionSlot(None, layer_number=5, nam=shared, sparse=True)
    shared.start(ForwardState(seq_layout=(2, tiny.seq_len)))
    x = torch.randn(tiny.seq_len, 2, tiny.hidden, requires_grad=True)
    out, bias = slot(x, attention_mask=None, rotary_pos_emb=None)
    assert bias is None and out.shape == x.shape
    out.float().square().mean().backward()
    assert slot.block.indexer.wk.weight.grad.abs().sum() > 0
    aux, notes = shared.end_step()
    assert set(aux) == {"indexer_kl"} and aux["indexer_kl"] > 0 and notes == []
    with pytest.raises(NamError, match="no D layer"):
        slots.AttentionSlot(None, layer_number=4, nam=shared, sparse=True)



# --- with megatron-core >= 0.19 importable

@needs_019
def test_config_and_spec_build_from_the_lowering(cfg):
    lowering = lower(cfg, ep=2)
    config = spec.transformer_config(lowering)
    assert (config.hidden_dropout, config.attention_dropout, config.moe_grouped_gemm) == (0.0, 0.0, False)
    assert config.params_dtype is torch.bfloat16 and config.pipeline_dtype is torch.bfloat16
    assert config.experimental_attention_variant == "dsa"  # the schedules then scale DSAIndexerLossAutoScaler
    stack = spec.hybrid_stack_spec(lowering, slots.Slots(cfg, None, {}))
    assert stack.params == {"post_layer_norm": False}
    sub = stack.submodules
    assert sub.mamba_layer.submodules.mixer.module is slots.MambaSlot
    assert sub.dsa_layer.submodules.self_attention.params["sparse"] is True
    assert sub.mla_layer.submodules.self_attention.params["sparse"] is False
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from nam56r.megatron import moe

    mlp = sub.moe_layer.submodules.mlp
    assert mlp.func is moe.NamMoELayer and issubclass(mlp.func, MoELayer)
    assert mlp.keywords["submodules"].experts.func is moe.ExpertsSlot  # SequentialMLP's place
    assert mlp.keywords["submodules"].shared_experts is not None




@needs_019
def test_stage_choice_patch_gives_megatron_the_chunk_and_reverts(cfg):
    """While a chunk builds for a schedule's stage, Megatron's segment choice returns that chunk's layers at
    their global offset and its MTP placement the chunk's; outside the choice Megatron decides; the patch
    scope puts both names back, also when the build raises."""
    from megatron.core.models.hybrid import hybrid_layer_allocation as allocation
    from megatron.core.models.hybrid import hybrid_model

    from nam_core.patches import applied

    saved = allocation.select_pipeline_segment, hybrid_model.mtp_on_this_rank
    [entry] = patches.lane()
    assert entry.impl.state()[0] == "needed" and entry.impl.reproduce() == "BUG_REPRODUCED"
    with applied([entry]):
        assert entry.impl.reproduce() == "FIX_VALIDATED"
        with patches.chosen_stage(["M", "E"], 26, mtp=True):
            assert allocation.select_pipeline_segment("M|E", None, 1) == (["M", "E"], 26)
            assert hybrid_model.mtp_on_this_rank(layout=None, mtp_num_layers=2) is True
        assert allocation.select_pipeline_segment.__wrapped__ is saved[0]  # outside a choice: Megatron's own
    assert (allocation.select_pipeline_segment, hybrid_model.mtp_on_this_rank) == saved
    with pytest.raises(RuntimeError, match="build failed"), applied([entry]), patches.chosen_stage(["M"], 0, mtp=False):
        raise RuntimeError("build failed")
    assert (allocation.select_pipeline_segment, hybrid_model.mtp_on_this_rank) == saved


@needs_019
def test_a_two_chunk_lowering_tells_megatron_the_virtual_size(cfg):
    from nam_core.engine.megatron.schedule import PipelineSchedule

    class TwoChunks(PipelineSchedule):
        name, chunks_per_rank = "two", 2

    config = spec.transformer_config(lower(cfg, pp=2, schedule=TwoChunks()))
    assert config.virtual_pipeline_model_parallel_size == 2  # LanguageModule's embedding setup reads it
    assert spec.transformer_config(lower(cfg, pp=2)).virtual_pipeline_model_parallel_size is None
