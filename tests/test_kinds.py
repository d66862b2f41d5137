"""The one table of backend kinds (nam56r/kinds.py) drives the host's registries and provider hooks, the model's
``Backends``, the config fields and the README's table; adding a kind is one table entry and a plugin."""

import dataclasses
import importlib
from pathlib import Path

import pytest

from nam56r.config import NAM56RConfig
from nam56r.kinds import BACKEND_KINDS
from nam56r.model import Backends, backends_class
from nam_core.device import DeviceInfo
from nam_core.host import PluginHost, discover
from nam_core.kinds import CORE_KINDS, Kind, installed_kinds
from nam_core.testing import fake_installed

CPU = DeviceInfo.profile("cpu")
README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.mark.parametrize("kind", BACKEND_KINDS, ids=[k.name for k in BACKEND_KINDS])
def test_each_kind_has_its_field_registry_hook_backends_slot_protocol_reference_and_readme_row(kind):
    defaults = {f.name: f.default for f in dataclasses.fields(NAM56RConfig)}
    assert defaults[kind.field] == kind.default  # the config field a run picks it by
    host = PluginHost()
    assert kind.name in host.registries and kind.hook in host.pm.hook.__dict__  # registry and provider hook
    assert kind.name in {f.name for f in dataclasses.fields(Backends)}
    module, _, name = kind.protocol.rpartition(".")
    protocol = getattr(importlib.import_module(module), name)
    reference = getattr(Backends.reference(), kind.name)
    assert isinstance(reference, protocol), (kind.name, type(reference).__name__)
    assert host.info("reference").provides[kind.name] == [kind.default]  # the essential plugin provides it
    assert f"| `{kind.name}` | `{kind.hook}` | `{kind.field}` | `{name}` |" in README


def test_the_host_knows_the_installed_table():
    assert installed_kinds() == (*CORE_KINDS, *BACKEND_KINDS)


# --- a new kind: the table entry, the config field it names, a plugin --------------------------------------
TOY = Kind.backend("toy", summary="a toy transform", protocol="tests.test_kinds.Toy")  # the one table entry


@dataclasses.dataclass(kw_only=True)
class ToyConfig(NAM56RConfig):
    toy_backend: str = "reference"
    """Kind ``toy``: who runs the toy transform."""


TOY_PLUGIN = '''
from nam_core import PluginInfo, hookimpl

PLUGIN = PluginInfo(summary="a toy backend", provides={"toy": ["plus-one"]}, selects={"toy_backend": "plus-one"})


class PlusOne:
    def __call__(self, x):
        return x + 1


@hookimpl
def nam_register_toy_backends(register):
    register("plus-one", PlusOne)
'''


def test_adding_a_backend_kind_is_one_table_entry_and_a_plugin(tmp_path, monkeypatch):
    installed = {"reference": discover()["reference"], **fake_installed(tmp_path, monkeypatch, {"toy": TOY_PLUGIN})}
    table = (*BACKEND_KINDS, TOY)
    # Without the entry the host refuses the plugin's kind; with it, the registry and the hook exist.
    [fail] = PluginHost(installed=installed).evaluate(["reference", "toy"], CPU).failures
    assert fail.name == "declaration" and "unknown kinds 'toy'" in fail.found
    host = PluginHost(installed=installed, kinds=(*CORE_KINDS, *table))
    host.activate(["reference", "toy"], CPU)
    assert host.registry("toy").plugin_of("plus-one") == "toy"
    # The model's backends object grows the slot from the same table.
    backends = backends_class(table).from_registries(host.registries, ToyConfig(toy_backend="plus-one"))
    assert backends.toy(41) == 42 and type(backends.ssm).__name__ == "ReferenceSSMScan"
    # And a run naming an implementation of the kind that nobody provides is refused at activation.
    from nam56r.run import spec_for

    spec = spec_for("nam56r-tiny")
    spec = spec.replace(backends={**spec.backends, "toy": "plus-two"}, plugins=("reference", "toy"))
    ev = PluginHost(installed=installed, kinds=(*CORE_KINDS, *table)).evaluate(spec.plugins, CPU, spec)
    assert [(c.name, c.found) for c in ev.failures] == [("toy_backend", "no installed plugin provides toy 'plus-two'")]


class Toy:  # the toy kind's protocol (what the table entry's ``protocol`` names)
    def __call__(self, x): ...
