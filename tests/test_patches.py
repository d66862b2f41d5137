"""The patch lane: state decided from the installed version and detect(); failures stop the run."""

import pytest

from nam_core.errors import PatchError
from nam_core.patches import APPLIED, NOT_APPLICABLE, NOT_INSTALLED, RETIRED, Patch, apply_all, unmet_floor
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


def test_version_below_range_is_not_applicable_not_retired():
    """A patch for a newer release than the installed one: nothing was fixed upstream, it just does not apply."""
    patch, state = make(versions=">=999.1")
    [report] = apply_all([Entry("demo", patch, "p")])
    assert report.state == NOT_APPLICABLE and state["applied"] == 0
    assert report.detail.endswith("not applicable: needs >= 999.1") and "fixed upstream" not in report.detail


@pytest.mark.parametrize("version, versions, floor", [
    ("0.16.1", ">=0.19", ">= 0.19"), ("0.19.2", ">=0.19", None), ("0.8.2", "<0.8.2", None),
    ("1.0", ">=1.2,<2", ">= 1.2"), ("2.5", ">=1.2,<2", None), ("0.1", ">0.1", "> 0.1"), ("0.0.9", ">0.1", "> 0.1"),
])
def test_unmet_floor(version, versions, floor):
    assert unmet_floor(version, versions) == floor


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


def _revertible(name="demo"):
    state = {"bug": True, "log": []}

    def apply():
        state["bug"] = False
        state["log"].append(f"apply {name}")

    def revert():
        state["bug"] = True
        state["log"].append(f"revert {name}")

    return Patch(name=name, target="pluggy", versions=">=0", summary="demo", retire_when="upstream 9.9",
                 detect=lambda: state["bug"], apply=apply, revert=revert), state


def test_a_scoped_patch_is_reverted_after_the_block_even_when_it_raises():
    from nam_core.patches import applied

    first, s1 = _revertible("a")
    second, s2 = _revertible("b")
    with pytest.raises(RuntimeError, match="inside"), applied([Entry("a", first, "p"), Entry("b", second, "p")]) as r:
        assert [x.state for x in r] == [APPLIED, APPLIED] and "fixed for this scope" in r[0].detail
        assert not s1["bug"] and not s2["bug"]
        raise RuntimeError("inside")
    assert s1["bug"] and s2["bug"] and s1["log"] + s2["log"] == ["apply a", "revert a", "apply b", "revert b"]


def test_a_patch_without_revert_cannot_be_scoped_and_a_failed_apply_reverts_the_others():
    from nam_core.patches import applied

    plain, _ = make()
    with pytest.raises(PatchError, match="has no revert"), applied([Entry("demo", plain, "p")]):
        pass
    good, state = _revertible("good")
    bad, _ = _revertible("bad")
    bad.apply = lambda: (_ for _ in ()).throw(RuntimeError("symbol moved"))
    with pytest.raises(PatchError, match="symbol moved"), applied([Entry("good", good, "p"), Entry("bad", bad, "p")]):
        pass
    assert state["bug"] and state["log"] == ["apply good", "revert good"]
