"""The plugin distributions of this checkout, read from the plugins/ folder (never a hand-kept list).

    python .ci/plugins.py              # the folders, for `pip wheel`:  plugins/nam-plugin-dualpipev ...
    python .ci/plugins.py --editable   # the README's install arguments: -e ./plugins/nam-plugin-dualpipev ...

A plugin is a folder ``plugins/nam-plugin-<name>`` with a ``pyproject.toml`` (``_template`` is none). A plugin
whose pyproject declares a ``test`` extra is installed with it for the test suite (``"./plugins/<folder>[test]"``).
tests/test_packaging.py checks the README's install line against ``editable_args()``.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def plugin_folders(root: Path = ROOT) -> list[Path]:
    """Every plugin distribution folder, by name."""
    return sorted(p.parent for p in root.glob("plugins/nam-plugin-*/pyproject.toml"))


def has_test_extra(folder: Path) -> bool:
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    return "test" in project.get("optional-dependencies", {})


def editable_args(root: Path = ROOT) -> list[str]:
    """``-e ./plugins/<folder>`` per plugin, ``"./plugins/<folder>[test]"`` (quoted as a shell needs) when it has
    a ``test`` extra."""
    args = []
    for folder in plugin_folders(root):
        path = f"./plugins/{folder.name}"
        args += ["-e", f'"{path}[test]"' if has_test_extra(folder) else path]
    return args


if __name__ == "__main__":
    if sys.argv[1:] == ["--editable"]:
        print(" ".join(editable_args()))
    elif not sys.argv[1:]:
        print(" ".join(str(p.relative_to(ROOT)) for p in plugin_folders()))
    else:
        sys.exit(f"usage: python .ci/plugins.py [--editable]  (found arguments {sys.argv[1:]})")
