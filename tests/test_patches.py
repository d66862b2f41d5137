"""The patch lane: state decided from the installed version and detect(); failures stop the run."""

import pytest

from nam_core.errors import PatchError
from nam_core.patches import APPLIED, NOT_INSTALLED, RETIRED, Patch, apply_all
from nam_core.registry import Entry


def make(target="pluggy", versions=">=0", present=True, apply=None, **kw):
    state = {"bug": present, "applied": 0}

    def default_apply():
        state["applied"] += 1
        state["bug"] = False

    patch = Patch(
        name="demo", target=target, versions=versions, summary="demo bug", retire_when="upstream 9.9",
        detect=lambda: state["bug"], apply=apply or default_apply, **kw,
    )
    return patch, state


def test_absent_distribution_is_not_installed():
    patch, _ = make(target="surely-not-installed-pkg")
    assert patch.state()[0] == NOT_INSTALLED


def test_version_outside_range_is_retired_and_not_applied():
    patch, state = make(versions="<0.1")
    [report] = apply_all([Entry("demo", patch, "p")])
    assert report.state == RETIRED and state["applied"] == 0
    assert "outside <0.1" in report.detail


def test_bug_absent_is_retired():
    patch, state = make(present=False)
    assert apply_all([Entry("demo", patch, "p")])[0].state == RETIRED
    assert state["applied"] == 0


def test_needed_patch_is_applied_once():
    patch, state = make()
    [report] = apply_all([Entry("demo", patch, "p")])
    assert report.state == APPLIED and state["applied"] == 1
    assert apply_all([Entry("demo", patch, "p")])[0].state == RETIRED  # idempotent: bug now gone


def test_apply_that_raises_stops_the_run():
    def boom():
        raise RuntimeError("symbol moved")

    patch, _ = make(apply=boom)
    with pytest.raises(PatchError) as e:
        apply_all([Entry("demo", patch, "p")])
    assert "symbol moved" in e.value.message and e.value.exit_code == 3


def test_apply_that_leaves_the_bug_stops_the_run():
    patch, _ = make(apply=lambda: None)
    with pytest.raises(PatchError, match="still detected"):
        apply_all([Entry("demo", patch, "p")])
