"""The megatron engine's training path on CPU processes over gloo: expert parallelism and pipelining
against the local engine, and resume, with Megatron-Core 0.19's CUDA calls replaced by a test double
(tests/megatron_gloo/cuda_double.py says what, and why the compared numbers do not depend on it).

Runs where megatron-core >= 0.19 and psutil import: the GPU host, or this project's Python 3.11 machines with
0.19's sources on the path (its only compiled part, the dataset helpers, is not used here)::

    mkdir -p /tmp/mcore && tar xJf .device-wheels/site.tar.xz -C /tmp/mcore ./megatron ./megatron_core-0.19.2.dist-info
    pip install --target /tmp/pylibs psutil
    PYTHONPATH=/tmp/mcore:/tmp/pylibs python -m pytest tests/test_megatron_engine_gloo.py

CI has 0.16.1 and skips with the reason. About nine minutes on 2 cores (three of them the recompute runs), and
about four more for the engine changes through `nam export`, three and a half for FusedAdam's (the stand-in)
state crossing both ways, and under a minute for the bf16-moments resume on the precision-aware stand-in
(measured one test at a time).

What equal means here: two runs of the same math in different summation orders part slowly under Adam.
Each comparison is bounded by the floor, the local engine against itself started from weights perturbed
by 1e-6 (tests/megatron_gloo/worker.py), and step 1, before any update, must agree to summation order.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nam_core.engine import megatron as engine
from nam_core.engine.megatron import checkpoint as megatron_checkpoint
from nam_core.engine.metrics import read_metrics

WORKER = Path(__file__).parent / "megatron_gloo" / "worker.py"
STEPS = 4

pytestmark = pytest.mark.skipif(
    (engine.megatron_version() or (0,)) < engine.MIN_MEGATRON or not engine.runtime_facts()["psutil"],
    reason="needs megatron-core >= 0.19 and psutil importable (CI has megatron-core 0.16.1)")


def _worker(engine_name: str, run_dir: Path, steps: int, *args: str, nproc: int = 1) -> None:
    """tests/megatron_gloo/worker.py in its own processes (under torchrun for the megatron engine)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if engine_name != "local" else [sys.executable])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([*launcher, str(WORKER), engine_name, str(run_dir), str(steps), *args],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _run(tmp_path: Path, name: str, engine_name: str, *args: str, nproc: int = 1, steps: int = STEPS) -> list[dict]:
    _worker(engine_name, tmp_path / name, steps, *args, nproc=nproc)
    return read_metrics(tmp_path / name)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The local engine with 4 micro-batches per step (2 data-parallel ranks x 2) and with 2 (one pipeline),
    each with its floor."""
    tmp = tmp_path_factory.mktemp("local")
    return {4: (_run(tmp, "local4", "local", "--grad-accum", "4"),
                _run(tmp, "floor4", "local", "--grad-accum", "4", "--perturb", "1e-6")),
            2: (_run(tmp, "local2", "local", "--grad-accum", "2"),
                _run(tmp, "floor2", "local", "--grad-accum", "2", "--perturb", "1e-6"))}


def _assert_close(megatron: list[dict], local: list[dict], floor: list[dict]) -> None:
    assert [m["step"] for m in megatron] == list(range(1, len(local) + 1))
    assert _rel(megatron[0]["loss"], local[0]["loss"]) <= 1e-6
    assert _rel(megatron[0]["grad_norm"], local[0]["grad_norm"]) <= 1e-5
    for m, l, f in zip(megatron, local, floor):
        allowed = max(1e-5, 3 * _rel(f["loss"], l["loss"]))
        assert _rel(m["loss"], l["loss"]) <= allowed, (m["step"], m["loss"], l["loss"], allowed)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """The megatron engine at EP 2 on 2 ranks (the dense weights data-parallel over both), no overlap, evaluating
    after steps 2 and 4 (worker.py's ``--eval``; the runs compared with it bit for bit do not evaluate, so they
    also show that an evaluation changes nothing in training); its run folder and metrics."""
    tmp = tmp_path_factory.mktemp("ep2")
    return tmp / "ep2", _run(tmp, "ep2", "megatron", "--ep", "2", "--eval", nproc=2)


def test_expert_parallel_matches_local_and_resumes_bit_exact(tmp_path, local, ep2):
    run_dir, full = ep2
    _assert_close(full, *local[4])
    log = (run_dir / "run.log").read_text()
    assert "overlap: none" in log
    assert "/checkpoints/step-00000002: training paused" in log and "in the background" in log  # the resume's source
    resumed = _run(run_dir.parent, "ep2", "megatron", "--ep", "2", "--eval", "--resume",
                   str(run_dir / "checkpoints" / "step-00000002"), nproc=2)
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in resumed[2:]] == \
           [(m["step"], m["loss"], m["grad_norm"]) for m in full[2:]]


def test_validation_is_a_forward_only_pass_over_the_held_out_rows(tmp_path, ep2):
    """worker.py's ``--eval`` holds out step 3's own training rows: evaluated after step 2, on the weights step 3
    trains from, val_loss is step 3's LM loss to float32 summation order, in the megatron engine (2 micro-batches on
    each of 2 ranks through the schedule's forward-only pass, chunks in eval mode) and in the local engine (4 on
    one). That the evaluations change nothing in training is the next test's: its run does not evaluate and
    matches this one's losses bit for bit."""
    local = _run(tmp_path, "local", "local", "--grad-accum", "4", "--eval")
    for name, metrics in (("megatron", ep2[1]), ("local", local)):
        assert [m["step"] for m in metrics if "val_loss" in m] == [2, 4], name
        assert _rel(metrics[1]["val_loss"], metrics[2]["lm_loss"]) <= 1e-6, (name, metrics[1], metrics[2])


def test_overlapped_grad_reduce_is_bit_exact_and_resumes(tmp_path, ep2):
    """train.overlap_grad_reduce at EP 2: the dense weights' gradients reduce-scattered during the backward pass,
    asynchronously on gloo. The same sums in the same order, so the same losses and gradient norms bit for bit;
    and resumed from step 2 bit-exact. (overlap_param_gather is refused by the engine: tests/
    test_megatron_engine.py.)"""
    overlap = ["--set=train.overlap_grad_reduce=true"]
    full = _run(tmp_path, "overlap", "megatron", "--ep", "2", *overlap, nproc=2)
    assert "overlap: grad reduce (" in (tmp_path / "overlap" / "run.log").read_text()
    assert [(m["loss"], m["grad_norm"]) for m in full] == [(m["loss"], m["grad_norm"]) for m in ep2[1]]
    resumed = _run(tmp_path, "overlap", "megatron", "--ep", "2", *overlap, "--resume",
                   str(tmp_path / "overlap" / "checkpoints" / "step-00000002"), nproc=2)
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in resumed[2:]] == \
           [(m["step"], m["loss"], m["grad_norm"]) for m in full[2:]]


def test_bf16_gradient_buffers_train_within_bf16_of_fp32_ones(tmp_path):
    """train.grad_reduce_in_fp32=false in bf16 (one rank, 4 micro-batches a step): Megatron's gradient buffers
    in bf16, as the run log says. Step 1's loss is computed before any update: equal. The buffers sum the
    micro-batches' gradients in bf16, so the gradient norm and the later losses move, by bf16 rounding (2**-8
    relative per sum; measured here below 1e-2) and not more."""
    runs = {}
    for name, value in (("fp32", "true"), ("bf16", "false")):
        runs[name] = _run(tmp_path, name, "megatron", "--dtype", "bfloat16",
                          f"--set=train.grad_reduce_in_fp32={value}", steps=2)
    log = lambda name: (tmp_path / name / "run.log").read_text()  # noqa: E731
    assert "gradient buffers in fp32 (train.grad_reduce_in_fp32)" in log("fp32")
    assert "gradient buffers in the parameters' dtype (train.grad_reduce_in_fp32)" in log("bf16")
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16[0]["loss"] == fp32[0]["loss"]
    assert bf16[0]["grad_norm"] != fp32[0]["grad_norm"]  # the bf16 sums did run
    assert _rel(bf16[0]["grad_norm"], fp32[0]["grad_norm"]) <= 1e-2
    assert _rel(bf16[1]["loss"], fp32[1]["loss"]) <= 1e-2


@pytest.mark.parametrize("choice, rtol", [("mamba,attention", 0.0), ("moe", 1e-6), ("layer", 1e-6)])
def test_recompute_against_none(tmp_path, ep2, choice, rtol):
    """train.recompute at EP 2, two steps. nam's checkpointing in the Mamba and attention slots (non-reentrant,
    as the local engine's): every logged number bit for bit. Megatron's own recompute, its selective ``moe``
    module and its full recompute of every layer (``layer``; the slots see its replay and log the indexer loss
    once): its reentrant checkpoint adds the replayed region's input gradient to the rest in another order, so
    the step-1 loss is exact and the gradient norms agree to ``rtol`` (measured: 1.1e-7 at step 1, 1.5e-7 at
    step 2, gloo, fp32)."""
    name = choice.replace(",", "-")
    full = _run(tmp_path, name, "megatron", "--ep", "2", f"--set=train.recompute={choice}", nproc=2, steps=2)
    timing = {"tokens_per_s", "tflops_per_device", "mem_gib", "step_time_s", "val_loss"}  # ep2 evaluates
    numbers = lambda rows: [{k: v for k, v in m.items() if k not in timing} for m in rows]  # noqa: E731
    plain = ep2[1][:2]
    if rtol == 0.0:
        assert numbers(full) == numbers(plain)  # loss, every loss term (the indexer KL logged once), grad norm
        return
    assert full[0]["loss"] == plain[0]["loss"] and full[0].keys() == plain[0].keys()
    for m, p in zip(full, plain):
        for key in set(numbers([m])[0]) - {"step", "lr"}:
            assert _rel(m[key], p[key]) <= max(rtol, 1e-5 if key != "grad_norm" else rtol) or \
                abs(m[key] - p[key]) <= 1e-6, (choice, m["step"], key, m[key], p[key])


def test_shared_expert_overlap_agrees_at_step_1(tmp_path, ep2):
    """train.moe_shared_expert_overlap at EP 2: the shared expert runs inside the dispatcher (on a side stream on
    a GPU; one stream here). Step 1, from the same weights, agrees with the run without it to 1e-6 in loss and
    gradient norm: only the order in which the hidden state's gradient terms are summed changes (the shared
    expert runs after the router, Megatron's moe_shared_expert_overlap docstring). Later steps are not compared:
    Adam's sign-like first update carries that rounding on (measured: loss 1.7e-6 and 2.3e-5 apart at steps 2
    and 3, gradient norm 8.7e-4 at step 2; each communication overlap alone: bit-exact)."""
    one = _run(tmp_path, "shared", "megatron", "--ep", "2", "--set=train.moe_shared_expert_overlap=true", nproc=2,
               steps=1)
    assert "overlap: shared expert (" in (tmp_path / "shared" / "run.log").read_text()
    plain = ep2[1][0]
    assert _rel(one[0]["loss"], plain["loss"]) <= 1e-6 and _rel(one[0]["grad_norm"], plain["grad_norm"]) <= 1e-6


def test_pipeline_1f1b_matches_local(tmp_path, local):
    """pp=2: each rank holds 26 layers; 2 micro-batches per step through Megatron's 1F1B schedule."""
    _assert_close(_run(tmp_path, "pp2", "megatron", "--pp", "2", nproc=2), *local[2])


def test_production_layout_eight_ranks_ep8(tmp_path):
    """Issue 9's layout, PP 1 and EP 8 on 8 ranks (2 of the 16 experts each), at tiny widths: 2 steps against
    the local engine with the same 16 micro-batches per step (the EP 8 all-to-all, the expert split and the
    distributed optimizer's checkpoint over 8 ranks). Memory is not measured here: the CUDA double reports 0."""
    steps = 2
    local = (_run(tmp_path, "local16", "local", "--grad-accum", "16", steps=steps),
             _run(tmp_path, "floor16", "local", "--grad-accum", "16", "--perturb", "1e-6", steps=steps))
    full = _run(tmp_path, "ep8", "megatron", "--ep", "8", nproc=8, steps=steps)
    _assert_close(full, *local)
    assert (tmp_path / "ep8" / "checkpoints" / "step-00000002" / "manifest.json").is_file()


def test_experts_replicated_over_data_parallel_ranks_ep2_on_4(tmp_path):
    """Issue 9's other layout, EP 4 on 8 GPUs, keeps each expert on 2 ranks: the expert weights' gradients are
    reduced, and their optimizer state sharded, over an expert-data-parallel group of 2, a path no EP = world
    run takes. Here at half size, EP 2 on 4 ranks (expert-data-parallel 2, data-parallel 4): 4 steps against the
    local engine with the same 8 micro-batches per step, then resumed from step 2, bit-exact."""
    local = (_run(tmp_path, "local8", "local", "--grad-accum", "8"),
             _run(tmp_path, "floor8", "local", "--grad-accum", "8", "--perturb", "1e-6"))
    full = _run(tmp_path, "ep2dp4", "megatron", "--ep", "2", nproc=4)
    _assert_close(full, *local)
    resumed = _run(tmp_path, "ep2dp4", "megatron", "--ep", "2", "--resume",
                   str(tmp_path / "ep2dp4" / "checkpoints" / "step-00000002"), nproc=4)
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in resumed[2:]] == \
           [(m["step"], m["loss"], m["grad_norm"]) for m in full[2:]]


def test_nam_train_megatron_with_index_cache_and_lemyx_hands_over(tmp_path):
    """Issue 9's plugin set on the megatron engine through `nam train` itself (activation on an H100 profile,
    the corpus, the run folder, the plugins' step hooks), EP 2: lemyx's dense warm-up trains the indexer KL
    for 2 steps, hands over to IndexCache's sparse top-k before step 3, and the loss falls."""
    run_dir = tmp_path / "cli"
    _worker("cli", run_dir, 4, "--", "train", "--engine", "megatron", "--ep", "2", "--device", "cuda",
            "--plugins", "index-cache,lemyx", "--set", "lemyx.backend=reference", "--set", "lemyx.warmup_steps=2",
            "--set", "attention_backend=reference", nproc=2)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and metrics[-1]["loss"] < metrics[0]["loss"]
    assert all(m["indexer_kl"] > 0 for m in metrics[:2])  # the dense warm-up's KL reaches the metrics
    log = (run_dir / "run.log").read_text()
    assert "[step 2] lemyx: step 2: indexer warm-up over after 2 steps" in log and "index-cache: FSSFSSFSS" in log
    plugins = json.loads((run_dir / "plugins.json").read_text())
    assert {"index-cache", "lemyx"} <= set(plugins["active"]) and plugins["backends"]["indexer"] == "Lemyx"
    assert plugins["megatron"]["ep"] == 2


def test_step1_gradients_per_parameter_at_ep2(tmp_path):
    """bench/megatron.py's per-parameter comparison (the tool for a step-1 gradient-norm gap): at EP 2 every
    Megatron parameter on both ranks has a local counterpart, and each gradient agrees to summation order."""
    _worker("grads", tmp_path, 1, "--ep", "2", nproc=2)
    for rank in (0, 1):
        rows = json.loads((tmp_path / f"grads_rank{rank}.json").read_text())["rows"]
        assert len(rows) > 500 and all(r["rel"] is not None for r in rows)  # experts stacked: 2 tensors per MoE layer
        assert max(r["rel"] for r in rows) <= 1e-4, rows[0]
        assert any(r["param"].endswith(".mlp.experts.w_gate_up") for r in rows)


def test_dualpipev_matches_1f1b_and_local_and_resumes_bit_exact(tmp_path, local):
    """pp=2 under dualpipev: 4 stages of 13 layers folded into a V (rank 0 holds stages 0 and 3, rank 1 stages
    1 and 2), 4 micro-batches a step through the plugin's schedule. Against Megatron's 1F1B on the same 2 ranks
    and against the local engine, from the same weights and rows: step 1 to summation order, every step
    within max(1e-5, 3 x floor); resumed from step 2, bit-exact."""
    pair = ("--pp", "2", "--grad-accum", "4")
    one_f_one_b = _run(tmp_path, "1f1b", "megatron", *pair, nproc=2)
    v = _run(tmp_path, "v", "megatron", *pair, "--schedule", "dualpipev", nproc=2)
    _assert_close(one_f_one_b, *local[4])
    _assert_close(v, *local[4])
    _assert_close(v, one_f_one_b, local[4][1])
    assert _rel(v[0]["loss"], one_f_one_b[0]["loss"]) <= 1e-6
    assert {"lm_loss", "mtp_loss", "moe_aux", "indexer_kl"} <= set(v[0])  # every loss reached rank 0's logs
    resumed = _run(tmp_path, "v", "megatron", *pair, "--schedule", "dualpipev", "--resume",
                   str(tmp_path / "v" / "checkpoints" / "step-00000002"), nproc=2)
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in resumed[2:]] == \
           [(m["step"], m["loss"], m["grad_norm"]) for m in v[2:]]


def test_sigterm_finishes_the_step_saves_on_every_rank_and_resumes(tmp_path):
    """`nam train --engine megatron` at EP 2 under torchrun, stopped with SIGTERM to its whole process group
    (what a scheduler's preemption does): every rank finishes the step, they agree on it, save one checkpoint
    of that step and say how to continue; `--resume auto` then goes on from it."""
    import signal
    import time

    run_dir = tmp_path / "stop"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    command = ["--", "train", "--engine", "megatron", "--ep", "2", "--device", "cuda", "--set",
               "attention_backend=reference", "--set", "train.checkpoint_every=1000"]
    proc = subprocess.Popen([*launcher, str(WORKER), "cli", str(run_dir), "40", *command], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-4000:]
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    steps = [m["step"] for m in read_metrics(run_dir)]
    stopped = steps[-1]
    assert 2 <= stopped < 40, steps
    assert f"stopped by SIGTERM after step {stopped} of 40" in err, err[-4000:]
    assert "continue with: " in err and "--resume auto" in err
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert saved == [f"step-{stopped:08d}"], saved  # off the checkpoint_every schedule: the stop's own save
    _worker("cli", run_dir, stopped + 1, *command, "--resume", "auto", nproc=2)
    assert [m["step"] for m in read_metrics(run_dir)][-2:] == [stopped, stopped + 1]


def test_weights_exported_from_a_local_run_start_the_megatron_engine(tmp_path):
    """Changing engines (issue 31): a local-engine run's checkpoint, exported (`nam export`), starts a megatron
    run through `nam train --init-from`. Its step-1 loss, before any update, is the local engine's step-1 loss
    from the same export to summation order (1e-6, fp32), and not the one from nam's initialisation: the weights
    crossed. (Weights only: the optimizer starts afresh in both.)"""
    from nam_cli.main import run

    sets = ["--set", "train.dtype=float32", "--set", "attention_backend=reference"]
    assert run(["train", "--run-dir", str(tmp_path / "first"), "--max-steps", "2", "--device", "cpu", *sets,
                "--set", "train.checkpoint_every=2", "-q"]) == 0
    assert run(["export", str(tmp_path / "first"), "--out", str(tmp_path / "export")]) == 0
    assert run(["train", "--run-dir", str(tmp_path / "local"), "--max-steps", "1", "--device", "cpu", *sets,
                "--init-from", str(tmp_path / "export"), "-q"]) == 0
    _worker("cli", tmp_path / "megatron", 1, "--", "train", "--engine", "megatron", "--device", "cuda", *sets,
            "--init-from", str(tmp_path / "export"))
    fresh, local, megatron = (read_metrics(tmp_path / name)[0] for name in ("first", "local", "megatron"))
    assert _rel(megatron["loss"], local["loss"]) <= 1e-6, (megatron, local)
    assert _rel(local["loss"], fresh["loss"]) > 1e-3, (local, fresh)
    assert "weights from" in (tmp_path / "megatron" / "run.log").read_text()


def test_a_megatron_checkpoint_exported_continues_in_the_local_engine(tmp_path, ep2):
    """Changing engines the other way (issue 31): ep2's checkpoint at step 2 (EP 2 on 2 ranks: each rank's experts
    in its own shards), exported by `nam export` (each tensor put together, renamed to nam56r's names), starts
    the local engine through --init-from on step 3's rows. Its step 1, before any update, is the megatron run's
    step 3 to summation order: loss within 1e-6 and gradient norm within 1e-5, relative (fp32; bf16's rounding
    alone is 4e-3), so every weight crossed, experts of both ranks included."""
    from nam_cli.main import run

    run_dir, full = ep2
    out = tmp_path / "export"
    assert run(["export", str(run_dir / "checkpoints" / "step-00000002"), "--out", str(out), "--tokenizer",
                "byte"]) == 0
    source = json.loads((out / "config.json").read_text())["source"]
    assert source["engine"] == "megatron" and source["layout"]["ep"] == 2
    local = _run(tmp_path, "local", "local", "--grad-accum", "4", "--init-from", str(out), "--first-batch", "8",
                 steps=1)
    step3 = next(m for m in full if m["step"] == 3)
    assert _rel(local[0]["loss"], step3["loss"]) <= 1e-6, (local[0], step3)
    assert _rel(local[0]["grad_norm"], step3["grad_norm"]) <= 1e-5, (local[0], step3)


def test_optimizer_state_exported_from_the_local_engine_continues_on_the_megatron_engine(tmp_path):
    """Changing engines mid-run (issue 31): a local run's checkpoint at step 2, exported with its optimizer
    (`nam export --with-optimizer`: AdamW's moments and step under nam56r's names), continues on the megatron
    engine at EP 2 (dense weights' optimizer state sharded over 2 data-parallel ranks, experts split over 2 EP
    ranks) through --init-from: steps 3 and 4 on the same rows as the local run's own, loss within 1e-5 and step
    4's gradient norm within 1e-4, relative (fp32; measured 1e-7). Step 4's gradient depends on step 3's update,
    which the carried moments and step count set: with exp_avg zeroed in the export, step 4's gradient norm is 43%
    off (3.26 for 2.27)."""
    from nam_cli.main import run

    local = _run(tmp_path, "local", "local", "--grad-accum", "4", "--set=train.checkpoint_every=2")
    out = tmp_path / "export"
    assert run(["export", str(tmp_path / "local" / "checkpoints" / "step-00000002"), "--out", str(out),
                "--tokenizer", "byte", "--with-optimizer", "--json"]) == 0
    assert json.loads((out / "config.json").read_text())["optimizer"] == {"step": 2, "numerics": "fp32-master",
                                                                          "dtype": "float32"}
    megatron = _run(tmp_path, "megatron", "megatron", "--ep", "2", "--init-from", str(out), nproc=2)
    assert [m["step"] for m in megatron] == [3, 4]
    for m, l in zip(megatron, local[2:]):
        assert m["lr"] == l["lr"] and _rel(m["loss"], l["loss"]) <= 1e-5, (m, l)
    assert _rel(megatron[1]["grad_norm"], local[3]["grad_norm"]) <= 1e-4, (megatron[1], local[3])
    assert "weights and optimizer state (AdamW step 2, fp32-master, float32)" in \
        (tmp_path / "megatron" / "run.log").read_text()


def _continued(tmp_path: Path, checkpoint: Path, grad_accum: int) -> list[dict]:
    """``checkpoint`` (step 2 of a megatron run) exported with its optimizer, continued by the local engine with
    ``grad_accum`` micro-batches a step (the megatron run's per step) through --init-from to step 4."""
    from nam_cli.main import run

    out = tmp_path / "export"
    assert run(["export", str(checkpoint), "--out", str(out), "--tokenizer", "byte", "--with-optimizer"]) == 0
    assert json.loads((out / "config.json").read_text())["optimizer"]["step"] == 2
    continued = _run(tmp_path, "local", "local", "--grad-accum", str(grad_accum), "--init-from", str(out))
    assert "weights and optimizer state (AdamW step 2" in (tmp_path / "local" / "run.log").read_text()
    return continued


def _assert_continues(continued: list[dict], original: list[dict]) -> None:
    """Steps 3 and 4 of the continuation are the original's: loss within 1e-5 and step 4's gradient norm (which
    step 3's update, hence the carried moments and step count, sets) within 1e-4, relative; fp32."""
    assert [m["step"] for m in continued] == [3, 4]
    for c, o in zip(continued, original[2:4]):
        assert c["lr"] == o["lr"] and _rel(c["loss"], o["loss"]) <= 1e-5, (c, o)
    assert _rel(continued[1]["grad_norm"], original[3]["grad_norm"]) <= 1e-4, (continued[1], original[3])


def test_optimizer_state_of_an_expert_parallel_run_continues_on_the_local_engine(tmp_path, ep2, capsys):
    """Megatron -> local mid-run (issue 31): ep2's step-2 checkpoint (EP 2: the dense weights' AdamW state
    sharded over both ranks' flat buckets, each rank's experts in its own) exported with its optimizer, read back
    per parameter through the ranks' optimizer maps, and continued by the local engine: steps 3 and 4 are ep2's
    (measured: 3e-7 in the gradient norm). A checkpoint without the maps (saved before nam wrote them) is refused
    with the way out."""
    import shutil

    from nam_cli.main import run

    run_dir, full = ep2
    _assert_continues(_continued(tmp_path, run_dir / "checkpoints" / "step-00000002", 4), full)

    older = tmp_path / "older" / "step-00000002"
    shutil.copytree(run_dir / "checkpoints" / "step-00000002", older)
    shutil.rmtree(older / "optimizer-map")
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["sha256"] = {k: v for k, v in manifest["sha256"].items() if not k.startswith("optimizer-map/")}
    (older / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert run(["export", str(older), "--out", str(tmp_path / "x"), "--tokenizer", "byte", "--with-optimizer"]) == 6
    err = capsys.readouterr().err
    assert "cannot be read per parameter (0 of 2 ranks' maps in optimizer-map/" in err and "--resume" in err, err
    assert run(["export", str(older), "--out", str(tmp_path / "weights"), "--tokenizer", "byte"]) == 0


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_optimizer_state_of_a_pipelined_run_continues_on_the_local_engine(tmp_path, schedule):
    """The same from PP 2 (each stage's layers and optimizer shards on their own rank, the token embedding on both
    the first stage and the last, for MTP), under 1F1B and under dualpipev (two model chunks per rank, 4
    micro-batches a step): steps 3 and 4 continued by the local engine are the megatron run's."""
    accum = 2 if schedule == "1f1b" else 4
    full = _run(tmp_path, "pp2", "megatron", "--pp", "2", "--grad-accum", str(accum), "--schedule", schedule,
                nproc=2)
    _assert_continues(_continued(tmp_path, tmp_path / "pp2" / "checkpoints" / "step-00000002", accum), full)


def test_a_bf16_runs_export_with_masters_continues_bit_for_bit(tmp_path):
    """bf16 with fp32 masters (train.optimizer_numerics=fp32-master) at EP 2: the step-2 checkpoint exported with its
    optimizer (the fp32 main weights as masters, each rounding to the exported bf16 weight, which the export
    checks) and continued by the megatron engine at the same layout through --init-from: steps 3 and 4 equal the
    original's bit for bit (loss and gradient norm), so the masters, moments and step count all crossed twice
    (megatron -> export -> megatron). With the masters in the export replaced by the bf16 weights, step 4's loss
    is 6.340851 for 6.341018 (measured)."""
    from nam_cli.main import run

    full = _run(tmp_path, "bf16", "megatron", "--ep", "2", "--dtype", "bfloat16", nproc=2)
    out = tmp_path / "export"
    assert run(["export", str(tmp_path / "bf16" / "checkpoints" / "step-00000002"), "--out", str(out),
                "--tokenizer", "byte", "--with-optimizer"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["optimizer"] == {"step": 2, "numerics": "fp32-master", "dtype": "bfloat16"}
    continued = _run(tmp_path, "continued", "megatron", "--ep", "2", "--dtype", "bfloat16", "--init-from", str(out),
                     nproc=2)
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in continued] == \
           [(m["step"], m["loss"], m["grad_norm"]) for m in full[2:]]


def test_fused_adams_state_crosses_both_ways(tmp_path):
    """Transformer Engine's FusedAdam as Megatron's inner Adam (what Megatron builds on the GPU hosts; here
    tests/megatron_gloo/fused_adam.py's stand-in, which keeps FusedAdam's layout: the step in each parameter group,
    exp_avg/exp_avg_sq made at the first step), one rank:
    1. megatron -> export -> megatron, bf16 with fp32-master: the step-2 checkpoint's optimizer map records the
       groups' step, the export reads it (step 2), and the continuation on the stand-in (state made by Megatron's
       init_state_fn, filled, every group's step set to 2) gives steps 3 and 4 bit for bit (loss and gradient norm).
    2. local -> megatron, fp32: a local run's step-2 export continued on the stand-in: steps 3 and 4 within the
       tolerances of the torch-AdamW test above (the stand-in's update rounds apart from torch's AdamW).
    Before nam read FusedAdam's group step, 1 failed at the export ("step counts differ ... ([])") and 2 at
    --init-from ("built for torch's AdamW, this run's is FusedAdam")."""
    from nam_cli.main import run

    full = _run(tmp_path, "bf16", "megatron", "--dtype", "bfloat16", "--fused-adam-stand-in")
    step2 = tmp_path / "bf16" / "checkpoints" / "step-00000002"
    assert json.loads((step2 / "optimizer-map" / "rank-00000.json").read_text())["steps"] == [2.0]
    out = tmp_path / "export"
    assert run(["export", str(step2), "--out", str(out), "--tokenizer", "byte", "--with-optimizer"]) == 0
    assert json.loads((out / "config.json").read_text())["optimizer"] == {"step": 2, "numerics": "fp32-master",
                                                                          "dtype": "bfloat16"}
    continued = _run(tmp_path, "continued", "megatron", "--dtype", "bfloat16", "--fused-adam-stand-in",
                     "--init-from", str(out))
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in continued] == \
           [(m["step"], m["loss"], m["grad_norm"]) for m in full[2:]]

    local = _run(tmp_path, "local", "local", "--grad-accum", "2", "--set=train.checkpoint_every=2")
    out = tmp_path / "export-local"
    assert run(["export", str(tmp_path / "local" / "checkpoints" / "step-00000002"), "--out", str(out),
                "--tokenizer", "byte", "--with-optimizer"]) == 0
    _assert_continues(_run(tmp_path, "from-local", "megatron", "--fused-adam-stand-in", "--init-from", str(out)),
                      local)
    assert "weights and optimizer state (AdamW step 2, fp32-master, float32)" in \
        (tmp_path / "from-local" / "run.log").read_text()


def test_bf16_moments_resume_bit_exact_with_the_targets_on_the_host_or_the_gpu(tmp_path):
    """train.optimizer_numerics=bf16-moments (Megatron's precision-aware optimizer: masters as bf16 weights plus int16
    remainders, bf16 moments) on tests/megatron_gloo/fused_adam.py's stand-in for TE's FusedAdam, one rank, bf16:
    resumed from step 2, steps 3 and 4 equal the uninterrupted run's bit for bit (loss and gradient norm), both with
    the load targets in host memory and kept on the device (``checkpoint.targets_stay``, which the run log names).
    The optimizer's tensors that would sit on the GPU during the load (the stand-in's ledger: its state, the copies
    its methods make, Megatron's dummies and torch's casts) peak at 14 bytes per parameter with the targets on the
    host (7/3 of the state's 6: Megatron's dummies 6, the remainders cast to bf16 2, the state rebuilt 6) and at 22
    with them on the device (the fp32 moments' targets 8 more). Before nam released the state before the load
    (issue 31) the peak was 28 bytes per parameter (measured: 101,817,024 bytes for a state of 21,868,448): the
    state 6, the targets' fp32 copies of the moments 8, FusedAdam's state_dict copies 8 and torch's casts 6."""
    args = ["--dtype", "bfloat16", "--precision-aware-stand-in", "--set=train.optimizer_numerics=bf16-moments"]
    full = _run(tmp_path, "bf16-moments", "megatron", *args)
    run_dir = tmp_path / "bf16-moments"
    assert "precision-aware optimizer" in (run_dir / "run.log").read_text()
    peaks = {}
    for where, extra in (("host memory", []), ("the GPU", ["--load-targets-fit"])):
        resumed = _run(tmp_path, "bf16-moments", "megatron", *args, *extra, "--resume",
                       str(run_dir / "checkpoints" / "step-00000002"))
        assert [(m["step"], m["loss"], m["grad_norm"]) for m in resumed[2:]] == \
               [(m["step"], m["loss"], m["grad_norm"]) for m in full[2:]], where
        assert (run_dir / "run.log").read_text().count(f"optimizer load targets {'in' if 'host' in where else 'on'} "
                                                       f"{where}") == 1
        ledger = json.loads((run_dir / "load-ledger.json").read_text())
        assert ledger["state"] > 0
        peaks[where] = ledger["peak"] / ledger["state"]
    assert peaks["host memory"] <= 2.4 and 3.5 <= peaks["the GPU"] <= 3.8, peaks


def test_checkpoints_on_the_training_thread_resume_the_same(tmp_path, ep2):
    """train.async_checkpoints=false at EP 2: Megatron's synchronous save (with its integrity.json) instead of
    the background one; the same losses, and the resume from step 2 continues bit for bit, as from ep2's
    background checkpoints."""
    sync = ["--set=train.async_checkpoints=false"]
    full = _run(tmp_path, "sync", "megatron", "--ep", "2", *sync, nproc=2)
    assert [m["loss"] for m in full] == [m["loss"] for m in ep2[1] if "loss" in m]
    assert "(written on the training thread)" in (tmp_path / "sync" / "run.log").read_text()
    assert (tmp_path / "sync" / "checkpoints" / "step-00000002" / "integrity.json").is_file()
    assert not (ep2[0] / "checkpoints" / "step-00000004" / "integrity.json").exists()
    resumed = _run(tmp_path, "sync", "megatron", "--ep", "2", *sync, "--resume",
                   str(tmp_path / "sync" / "checkpoints" / "step-00000002"), nproc=2)
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in resumed[2:]] == \
           [(m["step"], m["loss"], m["grad_norm"]) for m in full[2:]]
    # ep2's second background save reused the first one's save plans (one kept strategy, its structure cached):
    # it holds what the synchronous save of the same step holds, bit for bit
    background, _ = megatron_checkpoint.model_tensors(ep2[0] / "checkpoints" / "step-00000004")
    on_thread, _ = megatron_checkpoint.model_tensors(tmp_path / "sync" / "checkpoints" / "step-00000004")
    assert background.keys() == on_thread.keys() and len(background) > 5
    assert all(torch.equal(background[k], on_thread[k]) for k in background)


def test_a_resume_may_change_the_learning_rate_and_the_weight_decay(tmp_path):
    """train.lr and train.weight_decay are fields a resume may change (and the NaN guard's hint asks for a lower
    lr): Megatron-Core 0.19 pairs the saved param groups with this run's by their max_lr, min_lr and start_wd, so
    such a resume stopped on a KeyError. bf16 with its fp32 groups (their own start_wd): the resume runs, and
    step 3 runs at twice the lr the uninterrupted run had there (the same point of the schedule)."""
    first = ["--dtype", "bfloat16", "--set=train.weight_decay=0.1"]
    full = _run(tmp_path, "run", "megatron", *first)
    resumed = _run(tmp_path, "run", "megatron", *first, "--set=train.lr=0.006", "--set=train.weight_decay=0.05",
                   "--resume", str(tmp_path / "run" / "checkpoints" / "step-00000002"))
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    assert resumed[2]["lr"] == pytest.approx(2 * full[2]["lr"], rel=1e-12), (resumed[2], full[2])
    assert resumed[:2] == full[:2]  # what came before the checkpoint is kept as it was


def test_a_non_finite_step_keeps_the_checkpoint_that_was_being_written(tmp_path):
    """Checkpoints every 2 steps, written in the background; step 3's loss is NaN: the guard stops the run, and
    step 2's save, still in flight when the guard fired, is finished and named as the one to resume from (it
    was left as a hidden .tmp folder, and the error said none was kept)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    proc = subprocess.run([*launcher, str(WORKER), "megatron", str(run_dir), "4", "--non-finite-at", "2"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    kept = run_dir / "checkpoints" / "step-00000002"
    assert "non-finite loss at step 2" in proc.stderr and f"last good checkpoint is kept: {kept}" in proc.stderr, \
        proc.stderr[-3000:]
    assert megatron_checkpoint.inspect(kept)[0] is not None
    assert not list((run_dir / "checkpoints").glob(".step-*"))


def test_a_stop_during_the_start_trains_no_step_and_writes_no_checkpoint(tmp_path):
    """SIGTERM while the model is built or the checkpoint loads (a preemption then): the run stops before a
    step, as the local engine does, where it trained one more step and wrote a checkpoint of it."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    proc = subprocess.run([*launcher, str(WORKER), "megatron", str(run_dir), "4", "--stop-after-start"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    assert "stopped by SIGTERM after step 0 of 4" in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "checkpoints").is_dir() or not list((run_dir / "checkpoints").glob("*step-*"))
    assert read_metrics(run_dir) == []
