"""A stop asked for outside a training loop (Ctrl-C while plugins activate, data prepares, a model builds):
the command ends as a stop with the shell's exit code for the signal, not click's "Aborted!" with exit 1."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nam_cli import main as cli_main


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_during_setup_exits_with_the_signals_code(monkeypatch, capsys, signum, code):
    from nam_core import host

    def interrupted_setup(self, *args, **kwargs):
        os.kill(os.getpid(), signum)
        time.sleep(10)  # the handler raises before this returns
        raise AssertionError("the signal did not stop the command")

    monkeypatch.setattr(host.PluginHost, "__init__", interrupted_setup)
    before = signal.getsignal(signum)
    started = time.monotonic()
    assert cli_main.run(["plugins", "list"]) == code
    assert time.monotonic() - started < 5
    err = capsys.readouterr().err
    assert f"stopped: interrupted by {signal.Signals(signum).name}" in err, err
    assert signal.getsignal(signum) is before  # the CLI's handler is gone again
