"""NAM56R as a whole: pattern, counts, recipes, and the tiny model training on CPU through the registries."""

import json

import pytest
import torch

from nam56r.model import Backends, build_model
from nam56r.pattern import resolve
from nam56r.recipes import RECIPES, get_recipe
from nam_cli.main import run
from nam_core.device import DeviceInfo
from nam_core.errors import ConfigError
from nam_core.host import PluginHost
from nam_core.testing import no_host_sync

FULL = "AEMEDEMEDEMMDEMEAEMEDEMMDEMEDEMEAEMMDEMEDEMEDEMMAEME"


def test_full_pattern_resolves_exactly():
    plan = resolve("R*EME*EME*EMM*", 52, (0, 4, 8, 12))
    assert plan.resolved == FULL and plan.ngram_head
    assert plan.counts() == {"mla": 4, "dsa": 9, "mamba": 17, "moe": 22}
    assert [l.dsa_rank for l in plan.layers if l.kind == "dsa"] == list(range(9))
    assert resolve(FULL, 52, ()).resolved == FULL  # an explicit pattern is taken as written


@pytest.mark.parametrize(
    "pattern, pos, what",
    [
        ("*EMX*EME*EMM*", 3, "unknown symbol 'X'"),
        ("R*EME*ERE*EMM*", 7, "R (the n-gram head) may only come first"),
        ("*EME*eME*EMM*", 5, "unknown symbol 'e'"),
    ],
)
def test_pattern_errors_name_the_position(pattern, pos, what):
    with pytest.raises(ConfigError) as e:
        resolve(pattern, 52, (0, 4, 8, 12))
    assert f"position {pos}: {what}" in e.value.message


def test_mla_ranks_beyond_the_slots_are_an_error():
    with pytest.raises(ConfigError, match="13 attention slots"):
        resolve("*EME*EME*EMM*", 52, (0, 13))


def test_recipe_show_full_model_counts_on_meta(capsys):
    assert run(["recipe", "show", "nam56r", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    kinds = [layer["kind"] for layer in d["layers"]]
    assert len(kinds) == 52 and kinds.count("dsa") == 9 and kinds.count("mla") == 4
    assert kinds.count("mamba") + kinds.count("moe") == 39
    assert abs(d["params"]["total"] - 4.73e9) / 4.73e9 < 0.01
    assert d["params"]["active_per_token"] < d["params"]["total"]
    assert d["flops_per_token"] > 6 * d["params"]["active_per_token"] * 0.5


def test_unknown_recipe_is_a_usage_error(capsys):
    assert run(["recipe", "show", "nam99"]) == 2
    assert "unknown recipe 'nam99'" in capsys.readouterr().err


def test_every_recipe_keeps_the_52_layer_pattern_and_names_its_backends():
    for name in RECIPES:
        recipe = get_recipe(name)
        assert resolve(recipe.model.pattern, recipe.model.num_layers, recipe.model.mla_attention_ranks).counts() == {
            "mla": 4, "dsa": 9, "mamba": 17, "moe": 22}
        assert recipe.plugins
    assert get_recipe("nam56r-tiny").plugins == ["reference"]


def tiny_batch(cfg, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    segment_ids = (torch.arange(s) >= s // 2).long().expand(b, s).contiguous()  # two documents per row
    return dict(
        tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(b, s),
        segment_ids=segment_ids, structure=torch.randint(0, cfg.structure_vocab, (b, s), generator=g),
    )


def tiny_model_from_registries():
    recipe = get_recipe("nam56r-tiny")
    host = PluginHost()
    host.activate(recipe.plugins, DeviceInfo.profile("cpu"))
    torch.manual_seed(0)
    model = build_model(recipe.model, Backends.from_registries(host.registries, recipe.model))
    return recipe.model, model


def test_tiny_model_trains_through_the_registries():
    cfg, model = tiny_model_from_registries()
    batch = tiny_batch(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        out = model(**batch)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["lm_loss"].item())
    assert set(out) >= {"loss", "lm_loss", "mtp_loss", "moe_aux", "indexer_kl"}
    assert losses[-1] < losses[0] - 0.1, losses


def test_gradients_reach_every_parameter():
    cfg, model = tiny_model_from_registries()
    # Structure and n-gram output projections start at zero by design; a nudge lets gradient flow past them.
    with torch.no_grad():
        model.ngram.out_proj.weight.normal_(std=0.02)
        model.structure.embedding.weight.normal_(std=0.02)
    model(**tiny_batch(cfg))["loss"].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_backend_not_registered_names_the_provider():
    from nam_core.errors import UnknownBackendError

    host = PluginHost()
    host.activate(["reference"], DeviceInfo.profile("cpu"))
    cfg = get_recipe("nam56r").model  # names mamba-ssm, sparse-mla, liger
    with pytest.raises(UnknownBackendError) as e:
        Backends.from_registries(host.registries, cfg)
    assert "ssm 'mamba-ssm'" in e.value.message


def test_tiny_model_forward_backward_has_no_host_sync():
    cfg, model = tiny_model_from_registries()
    batch = tiny_batch(cfg)
    with no_host_sync():
        model(**batch)["loss"].backward()


def test_mtp_targets_do_not_cross_documents():
    from nam56r.model import shift_left

    seg = torch.tensor([[0, 0, 0, 1, 1, 1]])
    mask = shift_left(torch.ones(1, 6), 1) * (shift_left(seg, 1, fill=-1) == seg)
    assert mask.tolist() == [[1, 1, 0, 1, 1, 0]]
