"""The built-in reference plugin's config rule (no unfused DSA on a GPU unless chosen by name), and every recipe
naming a provider of each backend it selects (the reference plugin, where that is the reference)."""

import pytest

from nam56r.run import RunRequest, resolve, spec_for
from nam_core.device import DeviceInfo
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS

H100 = DeviceInfo.profile("h100")


def dsa_rows(spec, device=H100):
    ev = PluginHost().evaluate(["reference"], device, spec.replace(device=device))
    return ev, [c for c in ev.checks if c.name == "DSA on CUDA"]


def test_reference_attention_for_dsa_on_cuda_is_refused_by_default():
    ev, [row] = dsa_rows(spec_for("nam56r-tiny", device="cuda"))
    assert not ev.ok and row.status == FAIL
    assert "9 DSA layers" in row.found and "--plugins sparse-mla" in row.hint
    assert "--set attention_backend=reference" in row.hint


def test_choosing_the_reference_by_name_is_honoured_and_said():
    ev, [row] = dsa_rows(spec_for("nam56r-tiny", "attention_backend=reference", device="cuda"))
    assert ev.ok and row.status == PASS and "chosen by you" in row.found


def test_no_rule_on_cpu_or_without_dsa_layers():
    assert dsa_rows(spec_for("nam56r-tiny"), DeviceInfo.profile("cpu"))[1] == []
    no_dsa = spec_for("nam56r-tiny", "pattern=R*EMEM*", "num_layers=7", "mla_attention_ranks=0,1", device="cuda")
    ev, rows = dsa_rows(no_dsa)
    assert ev.ok and rows == []  # both attention slots are full MLA: nothing to refuse


PRODUCTION = ["index-cache", "lemyx"]
"""What bench/production.py adds to the nam56r recipe's plugins (issue 9's run)."""


@pytest.mark.parametrize("name,extra", [(n, []) for n in ("nam56r", "nam56r-small", "nam56r-tiny")]
                         + [("nam56r", PRODUCTION)])
def test_a_recipe_names_a_plugin_for_every_backend_it_selects(name, extra):
    """`nam train --recipe NAME` refuses at activation a run whose config names a backend no requested plugin
    provides; every recipe must request, by itself, a provider for each kind of nam56r/kinds.py (the nam56r
    recipe once named no provider of its routed experts, so every nam56r run, and issue 9's launch, stopped)."""
    from nam56r.kinds import BACKEND_KINDS

    host = PluginHost()
    spec = resolve(RunRequest(recipe=name, plugins=extra, env_plugins=False), host).spec
    infos = {n: host.info(n) for n in spec.plugins}
    assert None not in infos.values(), infos
    for kind in BACKEND_KINDS:
        value = getattr(spec.model, kind.field)
        providers = [n for n, info in infos.items() if value in info.provides.get(kind.name, ())]
        assert providers, f"{name} + {extra}: {kind.field}={value} ({kind.name}) is provided by none of {spec.plugins}"
