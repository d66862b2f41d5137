"""bench/float8_loss.py on CPU: the verdict's numbers from one seed and from several (``judge``), and the runs'
commands per seed (the GPU command must not break on a typo)."""

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("float8_loss")


def curve(level: float, steps: int = 40, wobble: float = 0.0):
    """A loss curve at ``level`` over its last steps, with an earlier, higher start (the tail is what counts)."""
    return [level + 1.0 if i < steps // 2 else level + wobble * (-1) ** i for i in range(steps)]


def test_several_seeds_judge_on_bf16_s_spread_and_the_means_over_the_seeds(bench):
    bf16 = {1: 2.50, 2: 2.56, 3: 2.53}
    curves = {"bf16": {s: curve(m) for s, m in bf16.items()},
              "fp8": {s: curve(m + 0.03) for s, m in bf16.items()},
              "te delayed": {s: curve(m + 0.08, wobble=0.01) for s, m in bf16.items()}}
    v = bench.judge(curves)
    assert v["noise"] == pytest.approx(0.06) and v["allowed"] == pytest.approx(0.06)
    assert v["gaps"]["fp8"] == pytest.approx(0.03) and v["gaps"]["te delayed"] == pytest.approx(0.08)
    assert v["mean"]["bf16"] == pytest.approx(2.53) and v["seeds"] == [1, 2, 3]
    assert v["per_seed"]["fp8"] == pytest.approx({1: 2.53, 2: 2.59, 3: 2.56})


def test_the_allowed_gap_is_held_between_band_and_cap(bench):
    wide = {"bf16": {1: curve(2.3), 2: curve(2.8)}, "fp8": {1: curve(2.3), 2: curve(2.8)}}
    assert bench.judge(wide)["allowed"] == bench.CAP  # a spread of 0.5 nats: capped
    tight = {"bf16": {1: curve(2.5), 2: curve(2.501)}, "fp8": {1: curve(2.5), 2: curve(2.5)}}
    assert bench.judge(tight)["allowed"] == bench.BAND  # a spread of 0.001: the floor


def test_one_seed_judges_on_the_bf16_seed_plus_one_run_as_before(bench):
    curves = {"bf16": {7: curve(2.56)}, "bf16, seed+1": {7: curve(2.63)}, "fp8": {7: curve(2.52)}}
    v = bench.judge(curves)
    assert v["noise"] == pytest.approx(0.07) and v["gaps"]["fp8"] == pytest.approx(-0.04)
    assert v["allowed"] == pytest.approx(0.07)


def test_runs_are_cut_to_the_shortest_before_the_tail_is_taken(bench):
    long, short = curve(2.0, steps=60), curve(3.0, steps=40)
    long[20:40] = [5.0] * 20  # the long run's steps 21-40 are what the shortest's tail lines up with
    v = bench.judge({"bf16": {1: short}, "bf16, seed+1": {1: short}, "fp8": {1: long}})
    assert v["n"] == 40 and v["mean"]["fp8"] == pytest.approx(5.0)


def test_each_seed_runs_in_its_own_folder_with_the_seed_offset(bench, tmp_path):
    a = bench.command("fp8", steps=200, seed=1234, root=tmp_path)
    b = bench.command("fp8", steps=200, seed=1235, root=tmp_path)
    c = bench.command("bf16, seed+1", steps=200, seed=1234, root=tmp_path)
    assert a[a.index("--run-dir") + 1] != b[b.index("--run-dir") + 1]
    assert a[a.index("--seed") + 1] == "1234" and b[b.index("--seed") + 1] == "1235"
    assert c[c.index("--seed") + 1] == "1235"
    assert "--plugins" in a and a[a.index("--plugins") + 1] == "float8"


def test_the_runs_trained_for_each_choice(bench):
    assert bench.run_names(te=False, te_only=False, seeds=1) == tuple(bench.RUNS)
    assert "bf16, seed+1" not in bench.run_names(te=True, te_only=False, seeds=3)
    assert bench.run_names(te=True, te_only=False, seeds=3)[-2:] == tuple(bench.TE_RUNS)
    assert bench.run_names(te=False, te_only=True, seeds=3) == ("bf16", "te current", "te delayed")
