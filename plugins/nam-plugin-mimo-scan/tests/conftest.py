"""What the CPU kernel tests share: running a snippet under Triton's interpreter in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def run_interpreted():
    """``run(code) -> dict``: ``code`` runs with ``TRITON_INTERPRET=1`` (set before Triton imports, hence the
    fresh process) and prints one JSON line last; skipped with the reason where Triton is not installed."""
    pytest.importorskip("triton", reason="the test extra installs Triton: "
                                         "pip install -e './plugins/nam-plugin-mimo-scan[test]'")

    def run(code: str) -> dict:
        env = dict(os.environ, TRITON_INTERPRET="1")
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run
