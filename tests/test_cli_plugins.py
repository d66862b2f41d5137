"""The CLI over the host: exit codes, JSON, and a real plugin distribution installed and uninstalled."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nam_cli.main import run

REPO = Path(__file__).resolve().parents[1]


def nam(*args, env=None) -> subprocess.CompletedProcess:
    """Run the installed ``nam`` command in a subprocess (fresh entry-point discovery)."""
    return subprocess.run([sys.executable, "-m", "nam_cli", *args], capture_output=True, text=True, env=env)


def test_version(capsys):
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.startswith("nam 0.")


def test_preflight_with_no_plugins_passes_and_reports_the_device(capsys):
    assert run(["preflight", "--device-profile", "h100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["device"]["smem_per_block_optin"] == 232_448


def test_unknown_plugin_exits_3_and_lists_installed(capsys):
    assert run(["preflight", "--plugins", "no-such-plugin"]) == 3
    out = capsys.readouterr().out
    assert "no-such-plugin" in out and "installed" in out and "reference" in out


def test_unknown_device_profile_is_a_usage_error(capsys):
    assert run(["preflight", "--device-profile", "tpu"]) == 2
    assert "unknown device profile 'tpu'" in capsys.readouterr().err


def test_malformed_command_line_exits_2(capsys):
    assert run(["preflight", "--no-such-flag"]) == 2


def test_plugins_list_json_shows_the_builtin_reference_plugin(capsys):
    assert run(["plugins", "list", "--json"]) == 0
    plugins = {p["name"]: p for p in json.loads(capsys.readouterr().out)["plugins"]}
    assert plugins["reference"]["distribution"] == "nam-train"
    assert "ssm" in plugins["reference"]["provides"]


def _make_plugin(tmp_path: Path, name: str, smem_bytes: int) -> Path:
    """A throwaway plugin distribution made from plugins/_template."""
    module = "nam_plugin_" + name.replace("-", "_")
    dest = tmp_path / f"nam-plugin-{name}"
    shutil.copytree(REPO / "plugins" / "_template", dest)
    (dest / "src" / "__MODULE__").rename(dest / "src" / module)
    for path in dest.rglob("*"):
        if path.is_file():
            path.write_text(path.read_text().replace("__NAME__", name).replace("__MODULE__", module))
    plugin_py = dest / "src" / module / "plugin.py"
    plugin_py.write_text(plugin_py.read_text().replace(
        "requires=(),", f"requires=(Requirement.shared_memory_per_block(at_least={smem_bytes}),),"
    ))
    return dest


@pytest.mark.slow
def test_installing_a_plugin_lists_it_preflight_judges_it_and_uninstalling_removes_it(tmp_path):
    name = "throwaway-smem"
    dist = _make_plugin(tmp_path, name, smem_bytes=160 * 1024)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    before = json.loads(nam("plugins", "list", "--json").stdout)
    assert name not in {p["name"] for p in before["plugins"]}
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(dist)], check=True)
    try:
        listed = {p["name"]: p for p in json.loads(nam("plugins", "list", "--json").stdout)["plugins"]}
        assert listed[name]["distribution"] == f"nam-plugin-{name}"
        assert listed[name]["provides"] == {"indexer": [name]}

        gb10 = nam("preflight", "--device-profile", "gb10", "--plugins", name, "--json")
        assert gb10.returncode == 3
        [row] = [c for c in json.loads(gb10.stdout)["checks"] if c["check"] == "shared memory per block"]
        assert row["status"] == "fail" and "101,376" in row["found"] and "163,840" in row["needed"]

        h100 = nam("preflight", "--device-profile", "h100", "--plugins", name)
        assert h100.returncode == 0, h100.stdout + h100.stderr
    finally:
        subprocess.run([*pip, "uninstall", "-y", f"nam-plugin-{name}"], check=True)
    after = json.loads(nam("plugins", "list", "--json").stdout)
    assert name not in {p["name"] for p in after["plugins"]}


def test_preflight_counts_every_failure():
    proc = nam("preflight", "--plugins", "no-such-plugin,other-missing")
    assert proc.returncode == 3
    assert "cannot run here: 2 checks failed" in proc.stdout


def test_preflight_engine_megatron_lists_what_this_process_lacks(capsys):
    """On a CPU machine (CI: megatron-core 0.16.1, no CUDA) the megatron engine rows fail, with hints, and the
    exit code says so; DeepEP's rows are the deepep plugin's, not the engine's."""
    from nam_core.engine.megatron import runtime_facts

    if runtime_facts()["cuda"]:
        pytest.skip("a CUDA device is visible")
    assert run(["preflight", "--engine", "megatron", "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    rows = {c["check"]: c for c in report["engine_checks"]}
    assert report["ok"] is False and report["engine"] == "megatron"
    assert rows["CUDA"]["status"] == "fail" and "nam train --engine local" in rows["CUDA"]["hint"]
    assert not any("DeepEP" in name for name in rows)
    assert "torchrun launch" not in rows  # preflight itself runs outside torchrun
    assert run(["preflight", "--engine", "deepspeed"]) == 2
