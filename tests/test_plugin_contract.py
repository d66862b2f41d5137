"""The contract every folder under plugins/ keeps, checked over all of them (a new plugin is covered by
existing here): one name spelled the same in folder, distribution, import package and entry point; a
``plugin.py`` that imports no kernel library (nor torch) when ``nam plugins list`` reads it; GPU libraries only in
extras, so a CPU install builds no CUDA code; a README a user can act on.

The folders are read from the checkout, not from what is installed, so a plugin that is not installed in this
environment fails here rather than going unnoticed.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"
FOLDERS = sorted(p for p in PLUGINS.glob("nam-plugin-*") if p.is_dir())

HEAVY = ("torch", "triton", "tilelang", "mamba_ssm", "liger_kernel", "megatron", "transformer_engine", "deep_ep",
         "torchao", "numpy")
"""Modules ``plugin.py`` must not import at module level (``nam plugins list`` reads every PLUGIN on a laptop)."""

GPU_DISTRIBUTIONS = {"triton", "tilelang", "mamba-ssm", "liger-kernel", "transformer-engine", "deep-ep", "torchao",
                     "flash-attn", "apache-tvm-ffi"}
"""Distributions that build or bring GPU code: allowed in a plugin's extras, never in its dependencies."""

README_SECTIONS = ("What it does", "Requirements")
README_CHECK_SECTIONS = ("Tests", "How to check it")
"""Every README says what the plugin does and what it needs, and how to check it (under one of these titles)."""


def _project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def _requirement_name(spec: str) -> str:
    return re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0].lower().replace("_", "-")


def test_the_checkout_has_plugins():
    assert len(FOLDERS) >= 8, FOLDERS  # a moved plugins/ folder must not make every check below vacuous


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_one_name_in_folder_distribution_package_and_entry_point(folder):
    name = folder.name.removeprefix("nam-plugin-")
    module = "nam_plugin_" + name.replace("-", "_")
    project = _project(folder)
    assert project["name"] == folder.name
    entry_points = project["entry-points"]["nam.plugins"]
    assert entry_points == {name: f"{module}.plugin"}, entry_points
    assert (folder / "src" / module / "plugin.py").is_file()
    [installed] = [ep for ep in importlib.metadata.entry_points(group="nam.plugins") if ep.name == name]
    assert installed.value == f"{module}.plugin", f"{folder.name} is not installed from this checkout"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_plugin_module_imports_no_kernel_library(folder):
    module = "nam_plugin_" + folder.name.removeprefix("nam-plugin-").replace("-", "_")
    code = f"import sys, {module}.plugin as p; assert p.PLUGIN; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"{module}.plugin imports {done.stdout.strip()} at module level"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_gpu_libraries_only_in_extras(folder):
    project = _project(folder)
    dependencies = {_requirement_name(d) for d in project.get("dependencies", [])}
    assert "nam-train" in dependencies
    assert not dependencies & GPU_DISTRIBUTIONS, f"GPU libraries in dependencies: {dependencies & GPU_DISTRIBUTIONS}"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_readme_says_what_it_does_needs_and_how_to_check_it(folder):
    titles = [line[3:].strip() for line in (folder / "README.md").read_text().splitlines() if line.startswith("## ")]
    missing = [s for s in README_SECTIONS if not any(t.startswith(s) for t in titles)]
    if not any(t.startswith(s) for s in README_CHECK_SECTIONS for t in titles):
        missing.append(" or ".join(README_CHECK_SECTIONS))
    assert not missing, f"{folder.name}/README.md lacks the sections {missing}; it has {titles}"
