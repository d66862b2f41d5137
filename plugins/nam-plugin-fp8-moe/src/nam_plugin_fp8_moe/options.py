"""``fp8-moe.*`` plugin options (``--set fp8-moe.backend=torch``: the prefix is the plugin name, as for every
plugin), parsed without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "fp8-moe"
BACKENDS = ("torch", "te")
OPTION_NAMES = ("backend", "amax_history")


class OptionError(ValueError):
    """An ``fp8-moe.*`` option that does not parse: ``(option, found, expected)``."""

    def __init__(self, option: str, found: str, expected: str):
        super().__init__(f"{option}={found!r}: expected {expected}")
        self.option, self.found, self.expected = option, found, expected


@dataclass(frozen=True)
class Options:
    backend: str = "torch"
    """``torch``: ``torch._scaled_mm`` (this plugin's kernels). ``te``: Transformer Engine (not built yet)."""
    amax_history: int = 16
    """Calls of amax kept per activation role; the scale is the history's max over FP8's max."""


def parse_options(raw) -> Options:
    """``fp8-moe.*`` entries of ``train.plugin_options`` -> Options; OptionError on the first bad one."""
    unknown = sorted(k for k in raw if k.startswith(f"{PREFIX}.") and k.split(".", 1)[1] not in OPTION_NAMES)
    if unknown:
        raise OptionError(unknown[0], raw[unknown[0]], f"one of {', '.join(f'{PREFIX}.{n}' for n in OPTION_NAMES)}")
    kwargs = {}
    if (v := raw.get(f"{PREFIX}.backend")) is not None:
        if v not in BACKENDS:
            raise OptionError(f"{PREFIX}.backend", v, f"one of {', '.join(BACKENDS)}")
        kwargs["backend"] = v
    if (v := raw.get(f"{PREFIX}.amax_history")) is not None:
        try:
            kwargs["amax_history"] = int(v)
        except ValueError:
            raise OptionError(f"{PREFIX}.amax_history", v, "an integer >= 1") from None
        if kwargs["amax_history"] < 1:
            raise OptionError(f"{PREFIX}.amax_history", v, "an integer >= 1")
    return Options(**kwargs)
