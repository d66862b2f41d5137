"""The plugin's face: activation, the config checks with their messages, the schedule selection, and the
engine adapter's refusals (one chunk per rank, per-token loss) and the auxiliary-loss scales it sets."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import nam_plugin_dualpipev.plugin as plugin
from nam56r.recipes import apply_overrides, get_recipe
from nam56r.run import spec_for
from nam_cli.main import run
from nam_core.checks import config_rows
from nam_core.device import DeviceInfo
from nam_core.errors import NamError, PluginActivationError
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS, SKIP
from nam_plugin_dualpipev.engine import DualPipeV

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")


def recipe(**train):
    """The RunSpec of nam56r-tiny with the plugin requested and a megatron layout DualPipeV accepts, changed by
    ``train`` (built by hand: the layout is hypothetical, no process group checks it here)."""
    from nam_core.run import Layout

    s = spec_for("nam56r-tiny", "attention_backend=reference", plugins=["dualpipev"], device="cuda")
    fields = dict(engine="megatron", device="cuda", dtype="bfloat16", pp=2, grad_accum=4, schedule="dualpipev")
    t = s.train.replace(**{**fields, **train})
    backends = {k: v for k, v in s.backends.items() if k != "schedules"}
    if t.schedule not in ("single", "1f1b"):
        backends["schedules"] = t.schedule
    return s.replace(train=t, engine=t.engine, backends=backends,
                     layout=Layout(tp=t.tp, pp=t.pp, ep=t.ep, world_size=t.tp * t.pp * t.ep))


def by_name(checks):
    return {c.name: c for c in checks}


def test_activates_without_a_config_and_registers_the_schedule():
    host = PluginHost()
    host.activate(["dualpipev"], CPU)
    assert host.registry("schedules").get("dualpipev") is DualPipeV
    assert plugin.PLUGIN.provides == {"schedules": ["dualpipev"]}


def test_a_layout_it_accepts_passes_every_check():
    checks = by_name(config_rows(plugin.NAME, plugin.PLUGIN, recipe()))
    assert {n for n, c in checks.items() if c.status == PASS} == {"layout", "V stages"} == set(checks)
    assert checks["layout"].found == "pp=2, ep=1, grad_accum=4"


@pytest.mark.parametrize("train, name, found, hint", [
    ({"ep": 2}, "layout", "ep=2, grad_accum=4: schedule dualpipev runs only with expert parallelism 1, found ep=2",
     "use --ep 1"),
    ({"pp": 1}, "layout", "pp=1, ep=1, grad_accum=4: schedule dualpipev needs pipeline parallelism > 1, found pp=1",
     "use --pp 2 (or more)"),
    ({"engine": "local", "device": "cpu", "dtype": "float32"}, "engine", "engine=local",
     "nam train --engine megatron --nproc N --pp N --plugins dualpipev"),
    ({"pp": 4, "grad_accum": 6}, "layout", "grad_accum >= 2 x pp = 8, found 6", "--set train.grad_accum=8"),
    ({"pp": 4, "grad_accum": 8}, "V stages", "num_layers=52", "choose --pp so that 2 x pp divides 52"),
])
def test_config_refusals_say_what_was_needed_found_and_what_to_do(train, name, found, hint):
    """The layout rows are DualPipeV.check_layout's refusals (the rules the engine applies), with its numbers."""
    check = by_name(config_rows(plugin.NAME, plugin.PLUGIN, recipe(**train)))[name]
    assert check.status == FAIL
    assert found in check.found and hint in check.hint
    with pytest.raises(PluginActivationError, match=rf"dualpipev: {name}: needs .*, found .*{re.escape(found)}") as e:
        PluginHost().activate(recipe(**train).plugins, H100, recipe(**train))
    assert e.value.exit_code == 3


def test_requesting_the_plugin_does_not_select_the_schedule_the_user_sets_it():
    """The plugin selects nothing, so the schedule stays the user's --set."""
    assert plugin.PLUGIN.selects == {}
    infos = {"dualpipev": PluginHost().info("dualpipev")}
    rec = apply_overrides(get_recipe("nam56r-tiny"), [], plugin_names=["dualpipev"], plugin_infos=infos)
    assert rec.train.schedule == "single"
    unused = recipe(schedule="1f1b")
    checks = by_name(c for c in PluginHost().evaluate(unused.plugins, H100, unused).checks if c.plugin == "dualpipev")
    assert checks["selected"].status == SKIP and checks["selected"].hint == "--set train.schedule=dualpipev"
    assert all(c.status != FAIL for c in checks.values())
    rec = apply_overrides(get_recipe("nam56r-tiny"), ["train.schedule=dualpipev"], plugin_names=["dualpipev"],
                          plugin_infos=infos)
    assert rec.train.schedule == "dualpipev"


def test_preflight_on_the_cpu_recipe_exits_3_naming_the_checks(capsys):
    assert run(["preflight", "--plugins", "dualpipev", "--recipe", "nam56r-tiny", "--json"]) == 3
    out = capsys.readouterr().out
    assert '"check": "engine"' in out and '"found": "engine=local"' in out


def call(model, **kwargs):
    schedule = DualPipeV(hidden_size=8)
    return schedule(forward_step_func=None, data_iterator=None, model=model, num_microbatches=4, seq_length=3,
                    micro_batch_size=2, **kwargs)


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_engine_adapter_refuses_anything_but_a_chunk_pair(chunks):
    assert DualPipeV.chunks_per_rank == 2  # what the engine reads to build the pair
    with pytest.raises(NamError, match=rf"runs two model chunks per pipeline rank .*; found {chunks} chunk") as e:
        call([nn.Linear(8, 8) for _ in range(chunks)])
    assert e.value.exit_code == 3 and "--set train.schedule=1f1b" in e.value.hint


class Chunk(nn.Linear):
    def set_input_tensor(self, x):
        self.input_tensor = x


@pytest.mark.parametrize("fields, found", [({"calculate_per_token_loss": True}, "calculate_per_token_loss"),
                                            ({"context_parallel_size": 2}, "context_parallel_size=2")])
def test_the_engine_adapter_refuses_loss_forms_it_does_not_wire(fields, found):
    model = [Chunk(8, 8), Chunk(8, 8)]
    model[0].config = type("Config", (), fields)()
    with pytest.raises(NamError, match=rf"sets {found}, which dualpipev does not wire") as e:
        call(model)
    assert e.value.exit_code == 3


def test_the_engine_adapter_sets_megatrons_auxiliary_loss_scales():
    """loss_scale / num_microbatches for the MoE, MTP and DSA auto-scalers, as Megatron's forward step sets them
    (needs megatron-core on the path; the scalers are process-wide class state)."""
    router = pytest.importorskip("megatron.core.transformer.moe.router")
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    config = type("Config", (), {"num_moe_experts": 4, "mtp_num_layers": 2, "experimental_attention_variant": None,
                                 "grad_scale_func": staticmethod(lambda x: x * 6.0)})()
    DualPipeV._set_aux_loss_scales(config, torch.device("cpu"), num_microbatches=4)
    assert router.MoEAuxLossAutoScaler.main_loss_backward_scale.item() == 1.5
    assert MTPLossAutoScaler.main_loss_backward_scale.item() == 1.5
    config.grad_scale_func = None
    DualPipeV._set_aux_loss_scales(config, torch.device("cpu"), num_microbatches=8)
    assert router.MoEAuxLossAutoScaler.main_loss_backward_scale.item() == 0.125


def test_the_engine_adapter_refuses_chunks_it_cannot_hand_inputs_to():
    with pytest.raises(NamError, match=r"model chunk 1 has no set_input_tensor") as e:
        call([Chunk(8, 8), nn.Linear(8, 8)])
    assert e.value.exit_code == 3
