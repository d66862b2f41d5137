"""The end-of-run summary: wall time, tokens/s, and the LM loss averaged over the last steps, apart from the MTP
and auxiliary losses (nam_core/engine/summary.py)."""

import json
import os
import time

import pytest

from nam_core.engine.summary import describe, summarize, window


def records(n: int) -> list[dict]:
    """``n`` steps whose LM loss falls by 0.1 a step, with an MTP and a router term beside it."""
    return [{"step": i + 1, "loss": 10.0 - 0.1 * i + 0.5 + 0.01, "lm_loss": 10.0 - 0.1 * i, "mtp_loss": 0.5,
             "moe_aux": 0.01, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0 + i, "tflops_per_device": 0.1,
             "mem_gib": 0.0, "step_time_s": 0.1} for i in range(n)]


@pytest.mark.parametrize("n, expected", [(1, 1), (5, 1), (11, 2), (100, 10), (200, 20), (100_000, 20)])
def test_window_is_a_tenth_between_one_and_twenty(n, expected):
    assert window(n) == expected


def test_lm_loss_is_averaged_apart_from_the_other_losses():
    s = summarize(records(100), wall_s=20.0, steps_run=100, tokens_per_step=256)
    assert s["loss_window"] == 10
    assert s["lm_loss_first"] == pytest.approx(10.0 - 0.1 * 4.5)  # steps 1..10
    assert s["lm_loss_last"] == pytest.approx(10.0 - 0.1 * 94.5)  # steps 91..100
    assert s["loss_last"] == pytest.approx(s["lm_loss_last"] + 0.51)
    assert s["other_losses_last"] == pytest.approx({"moe_aux": 0.01, "mtp_loss": 0.5})
    assert s["tokens"] == 25_600 and s["tokens_per_s"] == pytest.approx(1280.0)  # the wall average
    line = describe(dict(s, run_dir="runs/x"))
    assert "100 steps in 20.0 s; 25,600 tokens; 150 tokens/s, 0.1 TFLOP/s per device at the median step after " \
           "the first (first step 0.1 s: kernel builds, warm-up; 1,280 tokens/s over the wall time); " \
           "LM loss 9.5500 -> 0.5500" in line
    assert "mtp_loss 0.5" in line and line.endswith("run folder runs/x")


def test_the_first_step_is_apart_from_the_steady_state():
    """A first step 50x slower than the rest (kernel builds) moves the wall average, not the headline."""
    recs = records(10)
    recs[0].update(step_time_s=5.0, tokens_per_s=2.0, tflops_per_device=0.002)
    s = summarize(recs, wall_s=5.9, steps_run=10, tokens_per_step=10)
    assert s["step_tokens_per_s"] == pytest.approx(105.0)  # median of steps 2..10: 101..109
    assert s["step_time_s"] == pytest.approx(0.1) and s["step_tflops_per_device"] == pytest.approx(0.1)
    assert s["first_step_s"] == 5.0 and s["steady_steps"] == 9
    assert s["tokens_per_s"] == pytest.approx(100 / 5.9)


def test_a_resumed_run_measures_from_its_own_first_step():
    """Records of the earlier invocation (steps 1..5) are not this run's speed; step 6 is its first step."""
    recs = records(10)
    for r in recs[:5]:
        r["tokens_per_s"] = 1.0
    recs[5].update(step_time_s=7.0)
    s = summarize(recs, wall_s=8.0, steps_run=5, tokens_per_step=10, first_step=6)
    assert s["first_step_s"] == 7.0 and s["steady_steps"] == 4
    assert s["step_tokens_per_s"] == pytest.approx(107.5)  # median of steps 7..10: 106..109


def test_one_step_has_no_steady_state():
    s = summarize(records(1), wall_s=2.0, steps_run=1, tokens_per_step=64)
    assert s["step_tokens_per_s"] is None and s["first_step_s"] == 0.1
    line = describe(dict(s, run_dir="r"))
    assert "64 tokens; 32 tokens/s over the wall time (no step after the first to measure); first step 0.1 s" in line


def test_a_run_without_records_still_has_its_time():
    s = summarize([], wall_s=1.5, steps_run=0, tokens_per_step=None)
    assert s["wall_time_s"] == 1.5 and s["lm_loss_last"] is None and s["tokens_per_s"] is None
    assert describe(dict(s, run_dir="r")) == "done: 0 steps in 1.5 s; run folder r"


def test_the_time_from_launch_to_the_first_step(monkeypatch):
    """The launch is the environment's mark (the first nam process sets it; ranks inherit it); the line says
    when the first step ended after it. Without a mark (or a first step) there is no such number."""
    from nam_core.engine import summary as summary_

    monkeypatch.setenv(summary_.LAUNCHED_AT, "1000.000")
    monkeypatch.setattr(summary_, "_marks", {"resolve": time.time()})  # an earlier run's, after this launch's end
    s = summarize(records(3), wall_s=1.0, steps_run=3, tokens_per_step=10, first_step_done_at=1042.25)
    assert s["launch_to_first_step_s"] == 42.25 and s["startup_s"] == {"first step": 42.25}
    assert "(first step 0.1 s: kernel builds, warm-up; it ended 42.2 s after launch; " in describe(dict(s, run_dir="r"))
    assert summarize(records(3), wall_s=1.0, steps_run=3, tokens_per_step=10)["launch_to_first_step_s"] is None
    # the phases marked in this process (a phase marked before the launch, left from another run, is dropped)
    monkeypatch.setattr(summary_, "_marks", {"resolve": 1002.0, "data": 1030.5, "model": 990.0})
    s = summarize(records(3), wall_s=1.0, steps_run=3, tokens_per_step=10, first_step_done_at=1042.25)
    assert s["startup_s"] == {"resolve": 2.0, "data": 28.5, "first step": 11.75}
    assert "it ended 42.2 s after launch (resolve 2.0 s, data 28.5 s, first step 11.8 s);" in describe(dict(s, run_dir="r"))
    with pytest.raises(ValueError, match="start-up phase 'warmup'"):
        summary_.mark("warmup")
    monkeypatch.delenv(summary_.LAUNCHED_AT)
    assert summarize(records(3), wall_s=1.0, steps_run=3, tokens_per_step=10,
                     first_step_done_at=1042.25)["launch_to_first_step_s"] is None
    summary_.mark_launch()  # unset: this process's start
    assert abs(float(os.environ[summary_.LAUNCHED_AT]) - time.time()) < 60
    monkeypatch.setenv(summary_.LAUNCHED_AT, "1000.000")
    summary_.mark_launch()  # set by a parent nam: kept
    assert os.environ[summary_.LAUNCHED_AT] == "1000.000"


def test_summary_json_of_a_real_run(tmp_path, tmp_path_factory, capsys, monkeypatch):
    from nam_cli.main import run
    from nam_core.engine.metrics import read_metrics
    from nam56r.testing import prepare_corpus

    import textwrap

    corpus = prepare_corpus(tmp_path_factory, (textwrap,), chars=4000)
    run_dir = tmp_path / "run"
    launched = time.time()
    monkeypatch.setenv("NAM_LAUNCHED_AT", f"{launched:.3f}")
    assert run(["train", "--run-dir", str(run_dir), "--data", str(corpus), "--max-steps", "4", "--set", "seq_len=32",
                "--set", "train.micro_batch_size=2", "--set", "train.checkpoint_every=0",
                "--set", "train.log_every=3"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 3, 4]  # every 3rd, and the first and the last
    assert summary["steps_run"] == 4 and summary["tokens"] == 4 * 2 * 32
    assert summary["wall_time_s"] > 0 and summary["tokens_per_s"] > 0
    assert summary["first_step_s"] == metrics[0]["step_time_s"] and summary["steady_steps"] == 2
    # the model build and data before it, then the first step: longer than that step, shorter than the test so far
    assert summary["first_step_s"] < summary["launch_to_first_step_s"] < time.time() - launched
    assert summary["step_tokens_per_s"] == pytest.approx((metrics[1]["tokens_per_s"] + metrics[2]["tokens_per_s"]) / 2)
    # where the start-up went: the local engine's phases in order (no megatron model phase), summing to the whole
    phases = summary["startup_s"]
    assert list(phases) == ["resolve", "self-tests", "data", "engine", "first step"], phases
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) == pytest.approx(summary["launch_to_first_step_s"], abs=0.01)
    assert phases["first step"] == pytest.approx(summary["first_step_s"], abs=0.5)
    assert summary["lm_loss_last"] == pytest.approx(metrics[-1]["lm_loss"])  # window 1 at 3 records
    assert "mtp_loss" in summary["other_losses_last"] and "lm_loss" not in summary["other_losses_last"]
    assert "done: 4 steps in" in capsys.readouterr().out

