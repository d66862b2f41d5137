"""The built-in reference plugin's config rule (no unfused DSA on a GPU unless chosen by name), and every recipe
naming a provider of each backend it selects (the reference plugin, where that is the reference)."""

import dataclasses

import pytest

from nam56r.recipes import apply_overrides, get_recipe
from nam_core.device import DeviceInfo
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS

H100 = DeviceInfo.profile("h100")


def dsa_rows(rec, device=H100):
    ev = PluginHost().evaluate(["reference"], device, rec)
    return ev, [c for c in ev.checks if c.name == "DSA on CUDA"]


def on_cuda(rec):
    return dataclasses.replace(rec, train=rec.train.replace(device="cuda"))


def test_reference_attention_for_dsa_on_cuda_is_refused_by_default():
    ev, [row] = dsa_rows(on_cuda(get_recipe("nam56r-tiny")))
    assert not ev.ok and row.status == FAIL
    assert "9 DSA layers" in row.found and "--plugins sparse-mla" in row.hint
    assert "--set attention_backend=reference" in row.hint


def test_choosing_the_reference_by_name_is_honoured_and_said():
    rec = apply_overrides(on_cuda(get_recipe("nam56r-tiny")), ["attention_backend=reference"],
                          plugin_names=["reference"])
    ev, [row] = dsa_rows(rec)
    assert ev.ok and row.status == PASS and "chosen by you" in row.found


def test_no_rule_on_cpu_or_without_dsa_layers():
    assert dsa_rows(get_recipe("nam56r-tiny"), DeviceInfo.profile("cpu"))[1] == []
    rec = on_cuda(get_recipe("nam56r-tiny"))
    no_dsa = dataclasses.replace(rec, model=rec.model.replace(pattern="R*EMEM*", num_layers=7,
                                                                mla_attention_ranks=(0, 1)))
    ev, rows = dsa_rows(no_dsa)
    assert ev.ok and rows == []  # both attention slots are full MLA: nothing to refuse


BACKEND_FIELDS = {"ssm_backend": "ssm_mixers", "attention_backend": "attention_backends", "ce_backend": "ce_heads",
                  "indexer": "indexers", "moe_backend": "moe_experts"}
PRODUCTION = ["index-cache", "lemyx"]
"""What bench/production.py adds to the nam56r recipe's plugins (issue 9's run)."""


@pytest.mark.parametrize("name,extra", [(n, []) for n in ("nam56r", "nam56r-small", "nam56r-tiny")]
                         + [("nam56r", PRODUCTION)])
def test_a_recipe_names_a_plugin_for_every_backend_it_selects(name, extra):
    """`nam train --recipe NAME` builds every backend the config names from the active plugins' registries,
    and refuses to start when none provides one (UnknownBackendError, after activation). A recipe must
    therefore request, by itself, a provider for each: the nam56r recipe once named no provider of its
    routed experts (moe_backend=reference), so every nam56r run, and issue 9's launch, stopped there."""
    from nam_core.host import requested_plugins

    host = PluginHost()
    base = get_recipe(name)
    names = requested_plugins(base.plugins, extra, env=False)
    infos = {n: host.info(n) for n in names}
    assert None not in infos.values(), infos
    rec = apply_overrides(base, [], plugin_names=names, plugin_infos=infos)
    for field, kind in BACKEND_FIELDS.items():
        value = getattr(rec.model, field)
        providers = [n for n, info in infos.items() if value in info.provides.get(kind, ())]
        assert providers, f"{name} + {extra}: {field}={value} ({kind}) is provided by none of {names}"
