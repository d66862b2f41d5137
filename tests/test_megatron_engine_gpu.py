"""The megatron engine on GPUs: train, checkpoint, resume, and match the local engine (bench/megatron.py check).

Marked ``gpu``: skipped with a reason on CPU machines (root conftest). On the GPU host, with megatron-core
0.19.2 importable::

    PYTHONPATH=/tmp/site python -m pytest tests/test_megatron_engine_gpu.py -m gpu -v -k "4gpu and float32"

The engine test runs ``bench/megatron.py check`` in a subprocess (it starts torchrun itself), reads its JSON
and asserts on the numbers; the tolerances live in bench/megatron.py beside the measurements they came from.
``NAM_GPU_RESULTS=DIR`` keeps that JSON in DIR (one per GPU count and dtype; at 4 GPUs one check takes
about 270 s, so run one per call on a time-limited host). The CLI test runs
``nam train --engine megatron --nproc N`` the way a user does, then resumes it. Both run at 1, 2 and 4 GPUs
(EP = GPUs), each where the host has them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nam_core.engine import megatron as engine
from nam_core.errors import NamError

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[1] / "bench" / "megatron.py"


def _needs(gpus: int):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices, found {torch.cuda.device_count()}")
    if (engine.megatron_version() or (0,)) < engine.MIN_MEGATRON:
        pytest.skip("needs megatron-core >= 0.19 importable (e.g. PYTHONPATH=/tmp/site)")


def _check(tmp_path: Path, gpus: int, steps: int, dtype: str) -> dict:
    out = Path(os.environ.get("NAM_GPU_RESULTS", tmp_path)) / f"megatron_check_{gpus}gpu_{dtype}.json"
    proc = subprocess.run([sys.executable, str(BENCH), "check", "--gpus", str(gpus), "--steps", str(steps),
                           "--dtypes", dtype, "--json", str(out), "--work", str(tmp_path)], capture_output=True,
                          text=True)
    print(proc.stdout[-6000:], proc.stderr[-6000:])
    assert out.is_file(), f"bench/megatron.py check wrote no result (exit {proc.returncode})"
    return json.loads(out.read_text())


GPUS = [pytest.param(n, id=f"{n}gpu") for n in (1, 2, 4)]
"""EP = GPUs: 1 (no all-to-all), 2 and 4 (the all-to-all dispatcher, expert-parallel weights and checkpoints).
Each count skips where the host has fewer devices; on a multi-GPU host pick one with ``-k 4gpu`` (and a dtype
with ``-k "4gpu and float32"``)."""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("gpus", GPUS)
def test_megatron_engine_trains_resumes_and_matches_local(tmp_path, gpus, dtype):
    """20 steps of the tiny model: resumed == uninterrupted, megatron ~ local within the measured floor,
    step 1 equal up to summation order, the loss falls. One dtype per test: at 4 GPUs with 3 floor runs one
    check takes about 270 s."""
    _needs(gpus)
    result = _check(tmp_path, gpus, 20, dtype)
    assert result["meta"]["gpus"] == gpus and result["meta"]["floors"] >= 3
    assert result["failures"] == []
    r = result["results"][dtype]
    assert len(r["rows"]) == 20 and r["loss_falls"]
    assert r["rows"][0]["engine_rel"] <= result["meta"]["step1_rtol"][dtype]
    assert all(row["resumed"] is not None for row in r["rows"][10:])


@pytest.mark.parametrize("gpus", GPUS)
def test_nam_train_megatron_checkpoints_and_resumes(tmp_path, gpus):
    """The CLI path: `nam train --engine megatron --nproc N --ep N` trains 4 steps with checkpoints at 2 and
    4 (rank 0 writes the run folder); resumed from step 2 it logs the same steps 3 and 4."""
    _needs(gpus)
    from nam_core.engine.metrics import read_metrics

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "nam_cli", "train", "--engine", "megatron", "--nproc", str(gpus), "--ep", str(gpus),
           "--device", "cuda", "--run-dir", str(run_dir), "--max-steps", "4", "--set", "train.checkpoint_every=2",
           "--set", "attention_backend=reference", "--quiet"]  # the reference DSA on CUDA is refused unless named
    subprocess.run(cmd, check=True)
    first = read_metrics(run_dir)
    assert [m["step"] for m in first] == [1, 2, 3, 4]
    assert {"config.json", "plugins.json", "summary.json", "metrics.jsonl"} <= {p.name for p in run_dir.iterdir()}
    assert json.loads((run_dir / "summary.json").read_text())["engine"] == "megatron"
    subprocess.run(cmd + ["--resume", str(run_dir / "checkpoints" / "step-00000002")], check=True)
    again = read_metrics(run_dir)
    assert [m["step"] for m in again] == [1, 2, 3, 4]
    for a, b in zip(first[2:], again[2:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)


def test_nam_train_megatron_with_the_production_attention_plugins(tmp_path):
    """Issue 9's DSA plugins on the megatron engine, on GPUs, the way production.py launches them: sparse-mla's
    kernels, lemyx's Triton warm-up for 2 steps, then IndexCache's top-k; bf16, EP 2, tiny widths. The
    hand-over is logged, the warm-up's indexer KL reaches the metrics, and the loss falls. (The same path on
    CPU ranks with the reference backends: tests/test_megatron_engine_gloo.py.)"""
    _needs(2)
    from nam_core.engine.metrics import read_metrics

    run_dir = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "nam_cli", "train", "--engine", "megatron", "--nproc", "2", "--ep", "2",
                    "--device", "cuda", "--run-dir", str(run_dir), "--max-steps", "6",
                    "--plugins", "sparse-mla,index-cache,lemyx", "--set", "lemyx.warmup_steps=2",
                    "--set", "train.dtype=bfloat16", "--set", "train.checkpoint_every=100", "--quiet"], check=True)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6] and metrics[-1]["loss"] < metrics[0]["loss"]
    assert all(m["indexer_kl"] > 0 for m in metrics[:2])
    plugins = json.loads((run_dir / "plugins.json").read_text())
    assert plugins["backends"]["indexer"] == "Lemyx" and plugins["backends"]["attention"] != "ReferenceAttention"
    assert "lemyx: step 2: indexer warm-up over after 2 steps" in (run_dir / "run.log").read_text()


def test_allocator_is_set_before_cuda_and_refused_after(monkeypatch):
    """A fresh process that set nothing gets expandable segments, then allocates under them; a process whose
    CUDA is already up and has nothing set is refused."""
    _needs(1)
    code = ("import os, torch; from nam_core.engine.megatron import prepare_allocator; "
            "conf = prepare_allocator(os.environ, cuda_initialized=torch.cuda.is_initialized(), async_saves=True); "
            "x = torch.ones(1 << 20, device='cuda'); print(conf, os.environ['PYTORCH_CUDA_ALLOC_CONF'], x.sum().item())")
    env = {k: v for k, v in os.environ.items() if k not in engine.ALLOC_VARS}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == [engine.ALLOC_CONF, engine.ALLOC_CONF, str(float(1 << 20))]
    torch.zeros(1, device="cuda")
    for name in engine.ALLOC_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(NamError, match="CUDA was initialised before"):
        engine.prepare_allocator(os.environ, cuda_initialized=torch.cuda.is_initialized(), async_saves=True)
