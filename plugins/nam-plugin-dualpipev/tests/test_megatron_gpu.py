"""DualPipeV on the megatron engine, on 2 GPUs: NAM56R's 52 layers folded into a V (pp 2, 4 stages) against
Megatron's 1F1B on the same ranks (``bench/megatron.py pipeline``), and the CLI path a user takes.

Marked ``gpu``; needs 2 CUDA devices and megatron-core >= 0.19 importable (e.g. ``PYTHONPATH=/tmp/site``).
``NAM_GPU_RESULTS=DIR`` keeps the bench JSON in DIR.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nam_core.engine import megatron as engine

pytestmark = pytest.mark.gpu
BENCH = Path(__file__).resolve().parents[3] / "bench" / "megatron.py"


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
    if (engine.megatron_version() or (0,)) < engine.MIN_MEGATRON:
        pytest.skip("needs megatron-core >= 0.19 importable (e.g. PYTHONPATH=/tmp/site)")


def test_dualpipev_equals_1f1b_and_resumes(tmp_path):
    """10 steps, fp32 and bf16: every step's loss within max(ENGINE_RTOL, 3 x floor) of 1F1B's, step 1's loss
    within STEP1_RTOL and its gradient norm within max(STEP1_RTOL, 3 x floor), resumed from step 5 within
    RESUME_RTOL (bench/megatron.py)."""
    out = Path(os.environ.get("NAM_GPU_RESULTS", tmp_path)) / "megatron_pipeline_2gpu.json"
    proc = subprocess.run([sys.executable, str(BENCH), "pipeline", "--gpus", "2", "--steps", "10", "--json", str(out),
                           "--work", str(tmp_path)], capture_output=True, text=True)
    print(proc.stdout[-8000:], proc.stderr[-4000:])
    assert out.is_file(), f"bench/megatron.py pipeline wrote no result (exit {proc.returncode})"
    result = json.loads(out.read_text())
    assert result["failures"] == []
    for r in result["results"].values():
        assert len(r["rows"]) == 10 and r["worst"] <= r["allowed"]
        assert r["rows"][0]["grad_norm_rel"] <= r["step1_grad_norm_allowed"]


def test_nam_train_dualpipev_trains_and_resumes(tmp_path):
    """`nam train --engine megatron --nproc 2 --pp 2 --plugins dualpipev --set train.schedule=dualpipev`: 4 steps
    with checkpoints at 2 and 4; resumed from step 2 it logs the same steps 3 and 4."""
    from nam_core.engine.metrics import read_metrics

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "nam_cli", "train", "--engine", "megatron", "--nproc", "2", "--pp", "2",
           "--plugins", "dualpipev", "--set", "train.schedule=dualpipev", "--set", "train.grad_accum=4",
           "--device", "cuda", "--run-dir", str(run_dir), "--max-steps", "4", "--set", "train.checkpoint_every=2",
           "--set", "attention_backend=reference", "--quiet"]
    subprocess.run(cmd, check=True)
    first = read_metrics(run_dir)
    assert [m["step"] for m in first] == [1, 2, 3, 4]
    manifest = json.loads((run_dir / "checkpoints" / "step-00000004" / "manifest.json").read_text())
    assert manifest["layout"] == {"world_size": 2, "tp": 1, "pp": 2, "ep": 1, "chunks": 2}
    subprocess.run(cmd + ["--resume", str(run_dir / "checkpoints" / "step-00000002")], check=True)
    again = read_metrics(run_dir)
    for a, b in zip(first[2:], again[2:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)
