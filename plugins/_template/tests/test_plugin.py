from nam_core.device import DeviceInfo
from nam_core.host import PluginHost

import __MODULE__.plugin as plugin


def test_activates_on_cpu_and_registers_its_name():
    host = PluginHost()
    host.activate(["__NAME__"], DeviceInfo.profile("cpu"))
    assert "__NAME__" in host.registry("indexers")
    assert plugin.PLUGIN.provides["indexers"] == ["__NAME__"]
