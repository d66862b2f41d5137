"""What the distributions ship: every package folder of nam-train is in its wheel, and the install line a person
types (README.md, and .ci/run, which runs the README's line) names every plugin folder of the checkout.

The end-to-end check, nam run from wheels installed without ``-e``, is ``.ci/wheels.sh`` (a CI step, about a
minute); these are the cheap checks that name the line to fix.
"""

from __future__ import annotations

import importlib.util
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ci_plugins():
    spec = importlib.util.spec_from_file_location("ci_plugins", ROOT / ".ci" / "plugins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def package_folders() -> set[str]:
    """Import names of every folder holding an ``__init__.py`` under the distribution's package dirs."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(ROOT / folder).parts]))
    return found


def test_every_package_folder_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = package_folders()
    assert {"nam_core.engine.megatron", "nam56r.megatron", "nam_cli"} <= folders  # the walk sees nested packages
    assert folders - listed == set(), "package folders missing from pyproject.toml's [tool.setuptools] packages"
    assert listed - folders == set(), "pyproject.toml lists packages that have no folder with an __init__.py"


def install_line_plugins(line: str) -> list[str]:
    """The plugin arguments of a ``pip install -e ".[test]" -e ./plugins/...`` command, as the shell passes them;
    an AssertionError for one that is not an editable install."""
    words = shlex.split(line)
    found = [(words[i - 1], w) for i, w in enumerate(words) if w.startswith("./plugins/")]
    assert all(flag == "-e" for flag, _ in found), f"plugins installed without -e: {found}"
    return [w for _, w in found]


def test_the_readme_install_line_names_every_plugin_folder():
    ci = _ci_plugins()
    expected = [w for w in shlex.split(" ".join(ci.editable_args())) if w != "-e"]
    readme_line = next(line for line in (ROOT / "README.md").read_text().splitlines()
                       if line.startswith("python3 -m venv") and "python -m pytest" in line)
    assert len(expected) >= 10
    assert sorted(install_line_plugins(readme_line)) == sorted(expected), (
        "the README's test command must install every plugins/ folder (with [test] where it has that extra); "
        f"`python .ci/plugins.py --editable` prints them:\n{' '.join(ci.editable_args())}")


def test_the_plugin_list_reads_the_folder(tmp_path):
    ci = _ci_plugins()
    for name, extra in (("nam-plugin-b", False), ("nam-plugin-a", True)):
        (tmp_path / "plugins" / name).mkdir(parents=True)
        deps = '\n[project.optional-dependencies]\ntest = ["pytest"]\n' if extra else ""
        (tmp_path / "plugins" / name / "pyproject.toml").write_text(f'[project]\nname = "{name}"\n{deps}')
    (tmp_path / "plugins" / "_template").mkdir()
    (tmp_path / "plugins" / "_template" / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert ci.editable_args(tmp_path) == ["-e", '"./plugins/nam-plugin-a[test]"', "-e", "./plugins/nam-plugin-b"]


def test_the_memory_plans_constants_ship_in_the_wheel():
    """``nam train --dry-run`` of a NAM56R-shaped run reads nam56r/activations.json (nam56r/memory.py): it is
    package data of nam56r, so a wheel install plans as the checkout does (.ci/wheels.sh runs that plan)."""
    from nam56r.memory import ACTIVATIONS

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert ACTIVATIONS.name in data["nam56r"] and ACTIVATIONS.parent == ROOT / "nam56r" and ACTIVATIONS.is_file()
