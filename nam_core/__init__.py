"""nam's small core: hook specs, the plugin host, declarative requirements, the patch lane.

It knows nothing of NAM56R; the model package (``nam56r``) and plugins build on it.
"""

from nam_core.cudnn import when_te_installed

when_te_installed()  # before anything imports Transformer Engine: torch's cuDNN, not the system's (cudnn.py)

from nam_core.device import DeviceInfo  # noqa: E402
from nam_core.errors import NamError, PluginActivationError
from nam_core.hookspecs import hookimpl
from nam_core.patches import BUG_REPRODUCED, FIX_VALIDATED, Patch
from nam_core.plugin import PluginInfo
from nam_core.requirements import Check, Requirement

__version__ = "0.1.0"

__all__ = [
    "BUG_REPRODUCED", "FIX_VALIDATED", "Check", "DeviceInfo", "NamError", "Patch", "PluginActivationError",
    "PluginInfo", "Requirement", "__version__", "hookimpl",
]
