"""bench/production.py on CPU: the phase split of the report, the launch it makes, and how it fails."""

import argparse
import subprocess

import pytest


@pytest.fixture(scope="module")
def production(load_bench):
    return load_bench("production")


def _metrics(tokens, mem):
    return [{"step": i + 1, "tokens_per_s": t, "mem_gib": m, "loss": 10.0 - i} for i, (t, m) in
            enumerate(zip(tokens, mem))]


def test_phases_split_at_the_warmup_and_leave_out_the_first_steps_of_each(production):
    # steps 1-4 warm-up, 5-10 sparse; skip 1: warm-up timed over 2-4, sparse over 6-10
    metrics = _metrics([100, 5000, 5200, 5100, 300, 6000, 6100, 6200, 6300, 6400],
                       [50, 60, 61, 62, 70, 71, 72, 73, 74, 75])
    warm, sparse = production.phases(metrics, warmup_steps=4, skip=1, flops_per_token=30e9)
    assert (warm["first_step"], warm["last_step"], warm["steps"]) == (2, 4, 3)
    assert warm["tokens_per_s_per_gpu"] == 5100 and warm["peak_gib"] == 62
    assert (sparse["first_step"], sparse["last_step"], sparse["steps"]) == (6, 10, 5)
    assert sparse["tokens_per_s_per_gpu"] == 6200 and sparse["peak_gib"] == 75
    assert sparse["tflops_per_gpu"] == pytest.approx(6200 * 30e9 / 1e12)
    assert sparse["tflops_per_gpu_at_31.2"] == pytest.approx(6200 * 31.2e9 / 1e12)
    assert sparse["vs_published_tokens"] == pytest.approx(6200 / 9250)


def test_a_phase_with_no_step_left_is_absent(production):
    rows = production.phases(_metrics([1, 2, 3], [1, 1, 1]), warmup_steps=1, skip=1, flops_per_token=1.0)
    assert [r["phase"] for r in rows] == ["sparse (top-k)"] and rows[0]["first_step"] == 3


def _args(tmp_path, **kw):
    base = dict(gpus=8, ep=8, mbs=4, steps=100, warmup_steps=20, skip=3, run_dir=tmp_path / "run", quiet=False,
                json=None)
    return argparse.Namespace(**{**base, **kw})


def test_the_launch_is_the_production_one_and_a_failed_train_is_one_error(production, tmp_path, monkeypatch,
                                                                         capsys):
    calls = []

    def fake_run(cmd, *a, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if "preflight" in cmd else 137)

    monkeypatch.setattr(production.subprocess, "run", fake_run)
    assert production.run(_args(tmp_path, quiet=True)) == 137
    preflight, train = calls
    assert preflight[3:] == ["preflight", "--engine", "megatron", "--plugins", production.PLUGINS, "--recipe", "nam56r"]
    joined = " ".join(train)
    for part in ("train --recipe nam56r --engine megatron --nproc 8 --ep 8", f"--plugins {production.PLUGINS}",
                 "--max-steps 100", "train.micro_batch_size=4", "lemyx.warmup_steps=20", "train.checkpoint_every=0",
                 "--quiet"):
        assert part in joined
    err = capsys.readouterr().err
    assert "nam train exited with 137 (8 GPUs, EP 8, MBS 4)" in err
    assert str(tmp_path / "run" / "run.log") in err and "--mbs 3" in err


def test_a_failed_preflight_stops_before_training(production, tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(production.subprocess, "run",
                        lambda cmd, *a, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 3))
    assert production.run(_args(tmp_path)) == 3
    assert len(calls) == 1 and "nam preflight exited with 3" in capsys.readouterr().err


def test_a_warmup_as_long_as_the_run_is_refused(production, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(production.subprocess, "run", lambda *a, **kw: pytest.fail("nothing may start"))
    assert production.run(_args(tmp_path, steps=20, warmup_steps=20)) == 2
    assert "leaves no sparse step" in capsys.readouterr().err


def test_a_median_with_the_first_step_in_it_is_refused(production, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(production.subprocess, "run", lambda *a, **kw: pytest.fail("nothing may start"))
    assert production.run(_args(tmp_path, skip=0)) == 2
    assert "--skip must leave out at least the first step" in capsys.readouterr().err
