"""nam's pytest plugin (the ``pytest11`` entry point ``nam`` in nam's pyproject.toml): the fixtures nam's tests and
every plugin's tests get once nam is installed, in this checkout or out of it. The helpers they build on stay in
``nam_core.testing``, which imports no pytest, so preflight can use its parity harness on a host without it.

``fake_cpu``, ``fake_h100``, ``fake_h200``, ``fake_gb10`` (``nam_core.device.PROFILES``) and ``fake_a100`` are fake
devices; ``fake_versions(**{"triton": "3.4.0", "mamba-ssm": None})`` makes ``importlib.metadata.version``
report those releases for one test; ``run_interpreted(code)`` runs a snippet under Triton's CPU interpreter.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from pytest import fixture

from nam_core.device import DeviceInfo
from nam_core.testing import A100, fake_device

@fixture
def fake_cpu() -> DeviceInfo:
    """The CPU profile: no CUDA device."""
    return fake_device("cpu")


@fixture
def fake_h100() -> DeviceInfo:
    """H100 SXM 80GB: sm_90, 232,448 B shared memory per block, 132 SMs."""
    return fake_device("h100")


@fixture
def fake_h200() -> DeviceInfo:
    """H200: an H100's SM (sm_90, 232,448 B) with 141 GB."""
    return fake_device("h200")


@fixture
def fake_gb10() -> DeviceInfo:
    """sm_121 with 99 KiB (101,376 B) of shared memory per block: what a kernel sized for sm_90 may not fit."""
    return fake_device("gb10")


@fixture
def fake_a100() -> DeviceInfo:
    """A100 80GB: sm_80, 166,912 B shared memory per block: refused by whatever needs Hopper."""
    return A100


@fixture
def fake_versions(monkeypatch):
    """``fake_versions(**{"triton": "3.4.0", "mamba-ssm": None})``: ``importlib.metadata.version`` reports those
    releases (``None``: not installed) until the test ends; every other distribution as installed. A second call
    replaces the first's table."""
    real = importlib.metadata.version

    def fake(**table: str | None) -> None:
        def version(name: str) -> str:
            if name not in table:
                return real(name)
            if table[name] is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return table[name]

        monkeypatch.setattr(importlib.metadata, "version", version)

    return fake


# --- pytest fixture: Triton kernels on the CPU ------------------------------------------------------------


@fixture(scope="module")
def run_interpreted():
    """``run(code) -> dict``: ``code`` runs in a fresh process with ``TRITON_INTERPRET=1`` (Triton reads it at
    import, hence the process) and prints one JSON line last, which ``run`` returns. The test is skipped, with
    the reason, where Triton is not installed (a plugin's ``[test]`` extra brings it)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: install the plugin with its test extra, "
                    "pip install -e './plugins/nam-plugin-<name>[test]'")

    def run(code: str) -> dict:
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run
