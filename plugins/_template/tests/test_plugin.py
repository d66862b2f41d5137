"""__NAME__ on the CPU: activation registers its strategy under its name, and requesting the plugin selects it."""

from nam_core.device import DeviceInfo
from nam_core.host import PluginHost

from __MODULE__.plugin import NAME, PLUGIN
from __MODULE__.strategy import Strategy


def test_activates_on_cpu_and_registers_its_strategy():
    host = PluginHost()
    host.activate([NAME], DeviceInfo.profile("cpu"))
    assert host.registry("indexer").get(NAME) is Strategy
    assert PLUGIN.selects == {"indexer_backend": NAME}
