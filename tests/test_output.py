"""Output that is not a terminal (80 columns): tables wrap and never cut a name or a command."""

import pytest
from typer.testing import CliRunner

from nam_cli.main import app


@pytest.fixture
def piped(monkeypatch):
    """The CLI as a pipe sees it: 80 columns, no terminal, no plugins from the environment."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("NAM_PLUGINS", raising=False)
    return CliRunner()


WIDE = """
from nam_core import PluginInfo, Requirement
PLUGIN = PluginInfo(summary="a plugin whose package is missing everywhere", requires=(
    Requirement.package("nam-test-package-never-installed>=1.0",
                        install_hint="pip install nam-plugin-wide-kernel-plugin[gpu]  (then `nam plugins list`)"),
))
"""


def test_preflight_hints_appear_whole_when_piped(piped, tmp_path, monkeypatch):
    """The issue's case: at 80 columns the hint column read `pip install nam-plugin…` and the name was lost."""
    import nam_core.host
    from nam_core.testing import fake_installed

    installed = fake_installed(tmp_path, monkeypatch, {"wide-kernel-plugin": WIDE})
    monkeypatch.setattr(nam_core.host, "discover", lambda: installed)
    result = piped.invoke(app, ["preflight", "--plugins", "wide-kernel-plugin"])
    assert result.exit_code != 0  # the PluginActivationError (exit 3 through nam_cli.main.run)
    assert "  wide-kernel-plugin: pip install nam-plugin-wide-kernel-plugin[gpu]  (then `nam plugins list`)\n" \
        in result.output
    assert "…" not in result.output
    assert "│ wide-kernel-plugin │" in result.output  # the plugin's name on one line of its column


def test_plugin_and_distribution_names_are_never_cut(piped):
    from nam_core.host import PluginHost

    result = piped.invoke(app, ["plugins", "list"])
    assert result.exit_code == 0
    for name, plugin in PluginHost().installed.items():
        assert f" {name} " in result.output and f" {plugin.distribution} " in result.output
    assert "…" not in result.output


def test_patch_names_and_retire_conditions_are_whole_lines(piped):
    result = piped.invoke(app, ["patches"])
    assert result.exit_code == 0
    from nam_core.engine.megatron import patches

    for entry in patches.lane():
        assert f"{entry.impl.name}  (" in result.output
        assert f"retire when: {entry.impl.retire_when}" in result.output
