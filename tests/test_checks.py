"""Declared check rows (``nam_core.checks``): the host asks a plugin's ``ShapeCheck``/``LaunchCheck`` only when the
run uses its backend (or ``when`` says so), writes PASS/FAIL with the hint on a failure only, launches only on a
real device and never after a failed row, turns a raising check into a FAIL row, and registers the backend
classes ``provides`` names, with no hook in the plugin."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from nam_core.device import DeviceInfo
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS, SKIP
from nam_core.testing import fake_installed

DECLARED = '''
from nam_core import PluginInfo
from nam_core.checks import LaunchCheck, Measured, ShapeCheck

CALLS = []


class Head:
    pass


def widths(spec):
    ok = spec.model.moe_ffn_hidden % 8 == 0
    return ok, f"moe_ffn_hidden={spec.model.moe_ffn_hidden}" + ("" if ok else ": not a multiple of 8")


def launch(spec):
    CALLS.append(spec)
    ok = spec is None or spec.model.moe_ffn_hidden != 40
    return Measured(ok, "error 1e-3" if ok else "error 0.5", "within 1e-2 of the reference")


def boom(spec):
    raise RuntimeError("kernel did not compile")


PLUGIN = PluginInfo(
    summary="a declared ce head", provides={"ce": {"decl": "nam_fake_decl:Head"}},
    checks=(ShapeCheck("kernel shapes", "moe_ffn_hidden a multiple of 8", widths, "--set moe_ffn_hidden=32"),
            LaunchCheck("kernel launch", None, "nam_fake_decl:launch",
                        "report it; meanwhile --set ce_backend=reference"),
            LaunchCheck("option launch", "x", boom, "h", when=lambda spec: spec.train.seed == 7)),
)
'''

H100 = DeviceInfo.profile("h100")
REAL = dataclasses.replace(H100, profile_name=None)  # the host takes it for a real GPU: launch checks run


@pytest.fixture
def host(tmp_path, monkeypatch):
    installed = fake_installed(tmp_path, monkeypatch, {"decl": DECLARED})
    yield lambda: PluginHost(installed=installed)
    sys.modules.pop("nam_fake_decl", None)


def spec(*overrides, ce="decl"):
    from nam56r.run import spec_for

    s = spec_for("nam56r-tiny", *overrides)
    return s.replace(plugins=("decl",), backends={"ce": ce})


def rows(ev):
    return {c.name: c for c in ev.checks if c.plugin == "decl"}


def test_the_host_registers_the_declared_class_and_writes_the_shape_row_when_the_backend_is_used(host):
    h = host()
    ev = h.activate(["decl"], H100, spec())
    assert h.registry("ce").get("decl").__name__ == "Head" and h.registry("ce").plugin_of("decl") == "decl"
    row = rows(ev)["kernel shapes"]
    assert (row.status, row.needed, row.found, row.hint) == (PASS, "moe_ffn_hidden a multiple of 8",
                                                             "moe_ffn_hidden=32", None)
    bad = rows(host().evaluate(["decl"], H100, spec("moe_ffn_hidden=30")))["kernel shapes"]
    assert (bad.status, bad.found, bad.hint) == (FAIL, "moe_ffn_hidden=30: not a multiple of 8",
                                                 "--set moe_ffn_hidden=32")


def test_an_unused_backend_is_not_asked(host):
    got = rows(host().evaluate(["decl"], REAL, spec("moe_ffn_hidden=30", ce="reference")))
    assert "kernel shapes" not in got and "kernel launch" not in got
    assert sys.modules["nam_fake_decl"].CALLS == []


def test_launch_rows_run_on_a_real_device_only_and_never_after_a_failed_row(host):
    fake = rows(host().evaluate(["decl"], H100, spec()))
    assert fake["launch checks"].status == SKIP and "kernel launch" not in fake
    assert sys.modules["nam_fake_decl"].CALLS == []
    real = rows(host().evaluate(["decl"], REAL, spec()))
    launch = real["kernel launch"]
    assert (launch.status, launch.needed, launch.found) == (PASS, "within 1e-2 of the reference", "error 1e-3")
    assert len(sys.modules["nam_fake_decl"].CALLS) == 1
    refused = rows(host().evaluate(["decl"], REAL, spec("moe_ffn_hidden=30")))
    assert refused["kernel shapes"].status == FAIL and "kernel launch" not in refused
    assert len(sys.modules["nam_fake_decl"].CALLS) == 1  # no launch on a model already refused


def test_a_failed_launch_carries_the_hint_and_a_raising_one_is_a_failed_row(host):
    failed = rows(host().evaluate(["decl"], REAL, spec("moe_ffn_hidden=40")))["kernel launch"]
    assert (failed.status, failed.found) == (FAIL, "error 0.5")
    assert failed.hint == "report it; meanwhile --set ce_backend=reference"
    raised = rows(host().evaluate(["decl"], REAL, spec("train.seed=7")))
    assert "option launch" not in raised and raised["launch check"].found == \
        "it raised RuntimeError: kernel did not compile"


def test_without_a_run_launch_checks_are_asked_and_shape_checks_are_not(host):
    got = rows(host().evaluate(["decl"], REAL))
    assert "kernel shapes" not in got and got["kernel launch"].status == PASS
    assert sys.modules["nam_fake_decl"].CALLS == [None]


def test_a_launch_row_says_how_long_it_took_and_the_summary_ranks_them():
    """The activation's launch checks are the warm start's largest phase (27.9 of 34.9 s on an H200): each row
    carries its seconds (preflight --json, the summary's ``self_tests_s``, longest first); other rows do not."""
    import time as time_

    from nam_core.checks import LaunchCheck, ShapeCheck

    from nam_core.engine import summary

    def slow(spec):
        time_.sleep(0.05)
        return True, "ran"

    row = LaunchCheck("kernel launch", "x", slow, "h").row("p", None)
    assert row.status == "pass" and 0.05 <= row.seconds < 5 and row.to_dict()["seconds"] == row.seconds
    quick = LaunchCheck("quick", "x", lambda spec: (True, "ran"), "h").row("q", None)
    assert quick.seconds < row.seconds
    assert "seconds" not in ShapeCheck("shape", "x", lambda spec: (True, "ok"), "h").row("p", None).to_dict()
    summary.note_self_tests([quick, row])
    try:
        s = summary.summarize([], wall_s=1.0, steps_run=0, tokens_per_step=None)
        assert list(s["self_tests_s"]) == ["p: kernel launch", "q: quick"], s["self_tests_s"]
    finally:
        summary.note_self_tests([])
