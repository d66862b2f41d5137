"""Output that is not a terminal (80 columns): tables wrap and never cut a name or a command."""

import re

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
    assert "│ wide-kernel-plugin │" in result.output or "\nwide-kernel-plugin\n" in result.output  # whole
    assert "nam-test-package-never-installed>=1.0" in result.output  # a long word: one record per block


def test_plugin_and_distribution_names_are_never_cut(piped):
    from nam_core.host import PluginHost

    result = piped.invoke(app, ["plugins", "list"])
    assert result.exit_code == 0
    for name, plugin in PluginHost().installed.items():
        for whole in (name, plugin.distribution):  # a word of its own, in a table cell or a block line
            assert re.search(rf"(^|\s){re.escape(whole)}(\s|$)", result.output, flags=re.M), whole
    assert "…" not in result.output


def test_patch_names_and_retire_conditions_are_whole_lines(piped):
    result = piped.invoke(app, ["patches"])
    assert result.exit_code == 0
    from nam_core.engine.megatron import patches

    for entry in patches.lane():
        assert f"{entry.impl.name}  (" in result.output
        assert f"retire when: {entry.impl.retire_when}" in result.output


# --- noise: what an expected error, --help and nam patches do not say ---------------------------------


def test_an_expected_error_carries_no_debug_hint(capsys, monkeypatch):
    """Exit 2 (a bad --set) and 3 (a plugin that is not installed) say what to do; the traceback hint is for
    exit 1, a bug."""
    from nam_cli.main import run

    monkeypatch.delenv("NAM_DEBUG", raising=False)
    assert run(["train", "--dry-run", "--set", "no_such_field=1"]) == 2
    assert run(["preflight", "--plugins", "surely-no-such-plugin"]) == 3
    err = capsys.readouterr().err
    assert err.count("error:") == 2 and "NAM_DEBUG" not in err


def test_an_unexpected_error_points_to_the_traceback(capsys, monkeypatch):
    from nam_cli import main
    from nam_core.errors import NamError

    main.report(NamError("something broke"))
    assert "set NAM_DEBUG=1 for the full traceback" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["train", "--help"], ["preflight", "--help"], ["data", "prepare", "--help"],
                                  ["patches", "--help"], ["--help"]])
def test_help_shows_no_type_tags_on_flags_and_lists(piped, argv):
    result = piped.invoke(app, argv)
    assert result.exit_code == 0
    assert "<bool>" not in result.output and "<list[str]>" not in result.output and "--help" in result.output


def test_usage_names_arguments_in_capitals(piped):
    result = piped.invoke(app, ["data", "prepare", "--help"])
    assert "Usage: nam data prepare [OPTIONS] SRC " in result.output
    assert "{src}" not in result.output
    assert "--set KEY=VALUE" in " ".join(piped.invoke(app, ["train", "--help"]).output.split())


def test_patches_for_a_newer_release_are_not_applicable_here(piped):
    """On megatron-core 0.16.1 (Python 3.11) the engine's entries target >= 0.19: not applicable, not retired."""
    from nam_core.engine import megatron as engine

    if (engine.megatron_version() or (0,)) >= engine.MIN_MEGATRON:
        pytest.skip("megatron-core >= 0.19 is installed: the engine's entries are in range here")
    result = piped.invoke(app, ["patches"])
    assert "megatron-optimizer-fp32-groups  (megatron engine; megatron-core >=0.19): not-applicable" in result.output
    assert "megatron-core 0.16.1: not applicable: needs >= 0.19" in result.output
    assert "megatron-core 0.16.1 is outside" not in result.output


# --- tables never split a word ----------------------------------------------------------------------


def words_of(cells) -> set[str]:
    return {word for cell in cells for word in str(cell).split()}


def test_plugins_list_at_80_columns_splits_no_word_inside_a_name(piped):
    """The issue's cases: `mamba-ssm-impo|rt-shim`, `indexer_kernel|s:`, `torch.nn.fun|ctional.group|ed_mm`, and
    the cell that read `CUDA device a CUDA device: pass`."""
    import json

    result = piped.invoke(app, ["plugins", "list", "--device-profile", "h100"])
    assert result.exit_code == 0
    rows = json.loads(piped.invoke(app, ["plugins", "list", "--device-profile", "h100", "--json"]).output)["plugins"]
    names = {"mamba-ssm-import-shim", "indexer_kernels:", "torch.nn.functional.grouped_mm"}
    for row in rows:
        names |= {row["name"], row["distribution"], *(f"{k}:" for k in row["provides"])}
        names |= {n for v in row["provides"].values() for n in v}
        names |= words_of(r["needed"] for r in row["requires"])
    names = {n.strip(",;()") for n in names} - {""}
    missing = sorted(n for n in names if n not in result.output)
    assert not missing, missing
    assert "CUDA device a CUDA device" not in result.output and "a CUDA device: pass" in result.output


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_a_table_wraps_at_spaces_or_turns_into_blocks(width):
    """At any width each word of every cell is printed whole: the table where the longest words fit, one
    record per block where they do not."""
    from rich.console import Console

    from nam_cli.console import table

    rows = [("index-cache", "indexer: index-cache", "Shared DSA layers reuse the nearest Full layer's top-k"),
            ("grouped-moe", "moe: grouped", "torch.nn.functional.grouped_mm with autograd, int32 offsets, bf16")]
    t = table("plugin", "provides", "what it does", names=("plugin",))
    for row in rows:
        t.add_row(*row)
    console = Console(width=width, record=True, force_terminal=False, soft_wrap=True)  # as nam_cli.console.out
    console.print(t)
    text = console.export_text()
    missing = sorted(w for w in words_of(c for row in rows for c in row) if w not in text)
    assert not missing, (width, missing, text)
    tabular = "│" in text
    assert tabular == (width >= 80), text  # the longest words take about 75 columns with the borders
    if not tabular:
        assert "grouped-moe\n  provides: moe: grouped\n  what it does: torch.nn.functional.grouped_mm" in text


def test_patches_verify_runs_reproducers_only_where_the_target_is_there_and_names_one_that_raises(monkeypatch,
                                                                                                  capsys):
    """A target that is not installed (or in a version outside the patch's floor) has no code to reproduce on:
    skipped, not an error. A reproducer that raises on an installed target fails the command with a line that
    names it."""
    import json

    from nam_cli import patches as cli_patches
    from nam_cli.main import run
    from nam_core.patches import Patch
    from nam_core.registry import Entry

    def broken():
        raise RuntimeError("reproducer fell over")

    def entry(name, target):
        return Entry(name, Patch(name=name, target=target, versions=">=1", summary="demo", retire_when="never",
                                 detect=lambda: True, apply=lambda: None, reproduce=broken), "demo")

    lane = [entry("demo-absent", "nam-test-package-never-installed"), entry("demo-here", "pluggy")]
    monkeypatch.setattr(cli_patches, "_builtin", lambda: lane[:1])
    assert run(["patches", "--verify", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["patches"]}
    assert rows["demo-absent"]["verify"] == "skipped: not-installed"
    assert all(not r["verify"].startswith("ERROR") for r in rows.values()), rows  # every installed plugin's lane
    monkeypatch.setattr(cli_patches, "_builtin", lambda: lane)
    assert run(["patches", "--verify", "--json"]) == 1
    captured = capsys.readouterr()
    assert {r["name"]: r["verify"] for r in json.loads(captured.out)["patches"]}["demo-here"] == \
        "ERROR: RuntimeError: reproducer fell over"
    assert "error: the reproducer of demo-here raised" in captured.err
