"""nam-plugin-lemyx on CPU: the reference against a step-by-step form, the Triton kernel under Triton's
interpreter against the reference, the strategy's warm-up and hand-over inside the model, the config check,
and `nam train`. GPU parity at NAM56R's widths and the memory bound are in test_lemyx_gpu.py."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

import nam_plugin_lemyx.plugin as plugin
from nam56r.blocks.indexer import FullIndexer
from nam56r.model import Backends, build_model
from nam56r.recipes import get_recipe
from nam56r.state import ForwardState
from nam56r.testing import prepare_corpus
from nam_cli.main import run
from nam_core.checks import config_rows
from nam_core.device import DeviceInfo
from nam_core.engine.metrics import read_metrics
from nam_core.errors import ConfigError, PluginActivationError
from nam_core.run import StepContext
from nam56r.run import spec_for
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS, SKIP
from nam_plugin_lemyx.reference import kl_rows, warmup_reference
from nam_plugin_lemyx.strategy import Lemyx, Options, options_for

CPU = DeviceInfo.profile("cpu")
H100 = DeviceInfo.profile("h100")


# --- the reference against a step-by-step form -----------------------------------------------------
def naive(q, kv, iq, ik, w, scale, d_v, per_head=False):
    """Row by row, head by head, with Python loops: the definition of o and the KL."""
    b, s, h, _ = q.shape
    o = torch.zeros(b, s, h, d_v, dtype=q.dtype)
    kl = torch.zeros(b, s, dtype=q.dtype)
    for bi in range(b):
        for t in range(s):
            keys = kv[bi, : t + 1]  # [t+1, dk]
            probs = []
            for hh in range(h):
                p = torch.softmax(keys @ q[bi, t, hh] * scale, dim=0)
                o[bi, t, hh] = p @ keys[:, :d_v]
                probs.append(p)
            logits = torch.relu(ik[bi, : t + 1] @ iq[bi, t].T)  # [t+1, H]
            if per_head:
                terms = []
                for hh in range(h):
                    p, log_q = probs[hh], torch.log_softmax(logits[:, hh] * w[bi, t, hh], dim=0)
                    terms.append((p * (p.clamp(min=1e-10).log() - log_q)).sum())
                kl[bi, t] = torch.stack(terms).mean()
            else:
                p = torch.stack(probs).mean(0)
                log_q = torch.log_softmax(logits @ w[bi, t], dim=0)
                kl[bi, t] = (p * (p.clamp(min=1e-10).log() - log_q)).sum()
    return o, kl


def inputs(b=2, s=11, h=3, dk=8, H=3, di=4, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=dtype)
            for shape in ((b, s, h, dk), (b, s, dk), (b, s, H, di), (b, s, di), (b, s, H))]


@pytest.mark.parametrize("target", ["head-sum", "per-head"])
def test_reference_equals_the_step_by_step_definition(target):
    q, kv, iq, ik, w = inputs(seed=torch.seed() % 2**31)
    o, kl = warmup_reference(q, kv, iq, ik, w, scale=0.35, d_v=5, target=target)
    no, nkl = naive(q, kv, iq, ik, w, 0.35, 5, per_head=target == "per-head")
    torch.testing.assert_close(o, no, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kl, nkl, rtol=1e-10, atol=1e-12)
    assert kl[:, 0].abs().max() < 1e-12 and kl[:, 1:].min() > 0  # one key: KL 0; more: two different distributions


def test_reference_kl_trains_the_indexer_only():
    q, kv, iq, ik, w = [t.requires_grad_() for t in inputs()]
    kl_rows(q, kv, iq, ik, w, scale=0.35).sum().backward()
    assert q.grad is None and kv.grad is None
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (iq, ik, w))


# --- the Triton kernel under the interpreter --------------------------------------------------------
INTERPRETED = """
import json, torch
from nam_plugin_lemyx.selftest import compare
errors = compare(b=2, s=40, h=3, dk=32, dv=16, H=2, di=16, dtype=torch.float16, device="cpu", block=(16, 16))
print(json.dumps(errors))
"""


def test_triton_kernel_matches_the_reference_under_the_interpreter():
    """Every kernel (forward, attention and KL backward) on CPU through TRITON_INTERPRET=1, fp16 inputs.

    s=40 with 16-row tiles leaves a ragged last tile; 3 heads and 2 index heads are not powers of two.
    """
    pytest.importorskip("triton", reason="the test extra installs Triton: pip install -e './plugins/nam-plugin-lemyx[test]'")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    seed = errors.pop("seed")
    assert set(errors) == {"o", "kl", "dq", "dkv", "diq", "dik", "dw"}
    assert max(errors.values()) < 5e-3, (seed, errors)  # fp16 tolerance (selftest.TOLERANCE)


def test_a_nan_in_one_gradient_fails_the_parity_self_test(monkeypatch):
    """The preflight launch's number (``selftest.parity``): a fused kernel whose forward is right and whose dq has
    one NaN (not first in the table) must come out worse than any tolerance. A plain ``max`` over the errors let
    it through: ``max(1e-3, nan)`` is ``1e-3``."""
    import nam_plugin_lemyx.kernel as kernel
    from nam_core.testing import nan_in_gradient
    from nam_plugin_lemyx import selftest
    from nam_plugin_lemyx.reference import warmup_reference

    def broken(q, kv, iq, ik, w, *, scale, d_v, block):
        o, kl = warmup_reference(nan_in_gradient(q, at=1).float(), kv.float(), iq.float(), ik.float(), w.float(),
                                 scale=scale, d_v=d_v)
        return o.to(q.dtype), kl

    monkeypatch.setattr(kernel, "fused_warmup", broken)
    errors = selftest.compare(b=1, s=16, h=2, dk=32, dv=16, H=2, di=16, dtype=torch.float32, device="cpu")
    assert errors["dq"] == float("inf") and errors["o"] < 1e-5 and errors["dkv"] < 1e-5, errors
    worst, tolerance = selftest.parity(device="cpu", seq=16, dtype=torch.bfloat16)
    assert worst == float("inf") > tolerance


# --- options and the config check -------------------------------------------------------------------
PLUGINS = ["reference", "lemyx"]


def recipe(*overrides, plugins=PLUGINS, device="cpu"):
    """The RunSpec of `--plugins lemyx` (and ``plugins``) on the tiny recipe; a CUDA run on a fake H100."""
    return spec_for("nam56r-tiny", *overrides, plugins=plugins, device=device)


def config_checks(spec, device):
    """lemyx's config rows as the host writes them: its hook's, then the ones it declares (``PLUGIN.checks``)."""
    return by_name(plugin.nam_check_config(config=spec, device=device) + config_rows(plugin.NAME, plugin.PLUGIN, spec))


def by_name(checks):
    return {c.name: c for c in checks}


def test_backend_is_chosen_by_device_or_by_name_never_by_what_is_installed():
    assert options_for(recipe().options["lemyx"], "cpu") == Options(backend="reference", backend_source="default for cpu")
    assert options_for(recipe().options["lemyx"], "cuda").backend == "triton"
    assert options_for(recipe("lemyx.backend=reference").options["lemyx"], "cuda").backend_source == "set by you"
    opts = options_for(recipe("lemyx.warmup_steps=5", "lemyx.freeze_main=true", "lemyx.sparse=index-cache").options["lemyx"],
                       "cpu")
    assert (opts.warmup_steps, opts.freeze_main, opts.sparse) == (5, True, "index-cache")


@pytest.mark.parametrize("raw, message", [
    ("lemyx.warmup_steps=-1", "expected an integer >= 0 (warmup_steps: optimizer steps of dense attention"),
    ("lemyx.warmup_steps=ten", "expected an integer >= 0"),
    ("lemyx.backend=tilelang", "expected one of triton, reference"),
    ("lemyx.target=sum", "expected one of head-sum, per-head"),
    ("lemyx.freeze_main=maybe", "expected true or false"),
    ("lemyx.warmup=5", "has no option 'warmup' (did you mean lemyx.warmup_steps?)"),
])
def test_bad_options_are_refused_by_the_host_with_their_doc(raw, message):
    with pytest.raises(ConfigError) as e:
        recipe(raw)
    assert message in e.value.message and e.value.exit_code == 2


@pytest.mark.parametrize("raw, option", [
    (("lemyx.sparse=lemyx",), "lemyx.sparse"),
    (("lemyx.target=per-head",), "lemyx.target"),  # on cuda: the fused kernel is head-sum only
])
def test_option_combinations_that_cannot_run_are_one_failed_row(raw, option):
    [check] = plugin.nam_check_config(config=recipe(*raw, device="cuda"), device=H100)
    assert check.status == FAIL and check.found.startswith(f"{option}=")


def test_requesting_lemyx_selects_it_and_wraps_the_previous_indexer():
    rec = recipe()
    assert rec.model.indexer_backend == "lemyx" and rec.options["lemyx"].sparse == "full"
    assert rec.wrapped == {"indexer": "full"}
    rec = recipe(plugins=["reference", "index-cache", "lemyx"])
    assert rec.model.indexer_backend == "lemyx" and rec.options["lemyx"].sparse == "index-cache"
    assert rec.notes == ("indexer_backend=lemyx (selected by plugin lemyx; after it, lemyx.sparse=index-cache: "
                         "selected by plugin index-cache)",)
    ev = PluginHost().evaluate(rec.plugins, CPU, rec)
    assert {c.plugin: c.found for c in ev.checks if c.name == "selected"}["index-cache"] == \
        "indexer_backend=index-cache"  # used through lemyx
    rec = recipe("indexer=full")
    assert rec.model.indexer_backend == "full"
    ev = PluginHost().evaluate(rec.plugins, CPU, rec)
    assert {c.plugin: c.status for c in ev.checks if c.name == "selected"}["lemyx"] == SKIP


def test_config_check_on_cpu_says_the_reference_is_the_implementation():
    checks = config_checks(recipe(), CPU)
    assert checks["backend"].status == PASS and "CPU device: the pure-PyTorch path is the implementation" in \
        checks["backend"].found
    assert "1000 dense steps, then 'full'" in checks["schedule"].found
    assert all(c.status != FAIL for c in checks.values())


def test_config_check_on_cuda_requires_the_kernel_and_says_how_to_opt_out(fake_versions, fake_a100):
    checks = config_checks(recipe(device="cuda"), H100)
    assert checks["backend"].found.startswith("triton (default for cuda)")
    assert checks["CUDA capability"].needed == ">= sm_90"
    assert checks["kernel shapes"].status == PASS
    # The fused kernel takes bf16 / fp16 operands: the tiny recipe's fp32 is refused here, not at step 1.
    bad = checks["train.dtype"]
    assert bad.status == FAIL and bad.found == "train.dtype=float32" and "bfloat16 or float16" in bad.needed
    assert bad.hint == "--set train.dtype=bfloat16, or --set lemyx.backend=reference"
    assert "train.dtype" not in config_checks(recipe("train.dtype=bfloat16", device="cuda"), H100)
    assert "train.dtype" not in config_checks(recipe("lemyx.backend=reference", device="cuda"), H100)
    # A pre-Hopper GPU is refused with the reason and both ways out.
    checks = config_checks(recipe(device="cuda"), fake_a100)
    bad = checks["CUDA capability"]
    assert bad.status == FAIL and bad.found == "sm_80" and "lemyx.backend=reference" in bad.hint
    # Triton missing: refused, not a quiet switch to the reference path.
    fake_versions(triton=None)
    checks = config_checks(recipe(device="cuda"), H100)
    assert checks["package triton"].status == FAIL and "nam-plugin-lemyx[gpu]" in checks["package triton"].hint
    # The user's explicit choice of the reference path is honoured and named as such.
    checks = config_checks(recipe("lemyx.backend=reference", device="cuda"), H100)
    assert "chosen by you" in checks["backend"].found and "package triton" not in checks


@pytest.mark.parametrize("overrides, name", [
    (("kv_lora_rank=24",), "kernel shapes"),
    (("lemyx.backend=reference", "lemyx.target=per-head", "index_heads=2"), "target"),
    (("dsa_dense_warmup=true",), "dense warm-up"),
])
def test_config_check_refusals(overrides, name):
    checks = config_checks(recipe(*overrides, device="cuda"), H100)
    assert checks[name].status == FAIL, checks[name]
    with pytest.raises(PluginActivationError, match=f"lemyx: {name}"):
        PluginHost().activate(PLUGINS, H100, recipe("attention_backend=reference", *overrides, device="cuda"))


# --- the strategy inside the model --------------------------------------------------------------------
TINY = get_recipe("nam56r-tiny").model.replace(seq_len=24)


def run_model(backends, cfg, seed=3):
    torch.manual_seed(0)
    model = build_model(cfg, backends).double()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    out = model(tokens, tokens.roll(-1, 1), torch.ones(2, cfg.seq_len), state=ForwardState())
    out["loss"].backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert out_a.keys() == out_b.keys() and all(torch.equal(out_a[k], out_b[k]) for k in out_a)
    for name in grads_a:
        ga, gb = grads_a[name], grads_b[name]
        assert (ga is None and gb is None) or torch.equal(ga, gb), name


def test_warm_up_on_the_reference_path_equals_the_models_dense_stage_bit_for_bit():
    lemyx = Lemyx(FullIndexer(), Options(warmup_steps=3))
    ours = run_model(dataclasses.replace(Backends.reference(), indexer=lemyx), TINY)
    dense = run_model(Backends.reference(), TINY.replace(dsa_dense_warmup=True))
    assert_same(ours, dense)
    assert ours[0]["indexer_kl"] > 0


def test_the_per_head_target_set_on_the_command_line_reaches_the_models_kl():
    """``lemyx.target=per-head`` from the run's options to the warm-up's KL: one KL per head against its own index
    scores, which differs from the head-sum teacher's on the same model and tokens."""
    assert TINY.index_heads == TINY.attn_heads  # what the per-head target needs
    per_head = options_for(recipe("lemyx.target=per-head").options["lemyx"], "cpu")
    assert per_head.target == "per-head" and per_head.warmup_steps > 0
    kl = {o.target: run_model(dataclasses.replace(Backends.reference(), indexer=Lemyx(FullIndexer(), o)), TINY)[0]
          ["indexer_kl"] for o in (per_head, dataclasses.replace(per_head, target="head-sum"))}
    assert kl["per-head"] > 0 and kl["head-sum"] > 0 and not torch.equal(kl["per-head"], kl["head-sum"]), kl


def test_hand_over_at_the_configured_step_then_equals_the_wrapped_strategy():
    lemyx = Lemyx(FullIndexer(), Options(warmup_steps=3))
    assert [lemyx.at_step(s) for s in range(5)] == [False, False, False, True, False]
    assert not lemyx.warming_up() and lemyx.handed_over_at == 3
    ours = run_model(dataclasses.replace(Backends.reference(), indexer=lemyx), TINY)
    sparse = run_model(Backends.reference(), TINY)
    assert_same(ours, sparse)
    resumed = Lemyx(FullIndexer(), Options(warmup_steps=3))
    assert resumed.at_step(7) and not resumed.warming_up()  # a run resumed past the warm-up starts sparse
    assert not Lemyx(FullIndexer(), Options(warmup_steps=0)).warming_up()


class _Run(StepContext):
    """The StepContext an engine builds, around ``backends`` (and the model's parameters, if any)."""

    def __init__(self, backends, model=None, spec=None, max_steps=None):
        self.notes = []
        super().__init__(step=0, spec=spec or recipe(), backends=backends.as_mapping(),
                         parameters=model.named_parameters if model is not None else (lambda: iter(())),
                         note=self.notes.append, max_steps=max_steps)


def test_a_warm_up_longer_than_the_run_is_a_warning_and_the_report_says_no_hand_over():
    """The README's first example ran 10 steps of a 1000-step warm-up: the sparse strategy never ran."""
    lemyx = Lemyx(FullIndexer(), Options(warmup_steps=1000))
    fake = _Run(dataclasses.replace(Backends.reference(), indexer=lemyx), max_steps=10)
    plugin.nam_before_step(step=0, run=fake)
    assert fake.notes[1] == ("warning: lemyx: the indexer warm-up (1000 steps) does not end before this run stops at "
                             "step 10: every DSA layer attends densely to the end and 'full' never runs; "
                             "--set lemyx.warmup_steps=N with N < 10 hands over earlier")
    fake.step = 10
    assert plugin.nam_run_report(run=fake) == ("lemyx: dense warm-up to the last step, 10 (warm-up 1000 steps): no "
                                               "hand-over to 'full' in this run")
    short = Lemyx(FullIndexer(), Options(warmup_steps=4))
    fake = _Run(dataclasses.replace(Backends.reference(), indexer=short), max_steps=10)
    for step in range(10):
        plugin.nam_before_step(step=step, run=fake)
    assert not any(n.startswith("warning:") for n in fake.notes)
    fake.step = 10
    assert plugin.nam_run_report(run=fake) == "lemyx: dense warm-up until step 4, then 'full' to step 10"


def test_the_config_check_warns_of_a_warm_up_past_the_schedule():
    def schedule_row(spec):
        return by_name(config_rows(plugin.NAME, plugin.PLUGIN, spec))["schedule"]

    long = schedule_row(recipe())  # 1000 of 200 steps
    assert long.status == PASS and "warning: not before train.total_steps (200), so 'full' never runs" in long.found
    short = schedule_row(recipe("lemyx.warmup_steps=50"))
    assert short.found == "50 dense steps, then 'full'"


def test_freeze_main_trains_only_the_indexers_until_the_hand_over():
    lemyx = Lemyx(FullIndexer(), Options(warmup_steps=2, freeze_main=True))
    backends = dataclasses.replace(Backends.reference(), indexer=lemyx)
    model = build_model(TINY, backends)
    fake = _Run(backends, model)
    plugin.nam_before_step(step=0, run=fake)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".indexer." in n for n in trainable)
    plugin.nam_before_step(step=1, run=fake)
    plugin.nam_before_step(step=2, run=fake)
    assert all(p.requires_grad for p in model.parameters())
    assert len(fake.notes) == 2 and "main model frozen" in fake.notes[0]
    assert fake.notes[1].startswith("lemyx: step 2: indexer warm-up over after 2 steps")


def test_on_the_megatron_engine_freezing_is_refused_and_the_hand_over_touches_no_parameter():
    """The megatron engine's context hands hooks no parameters to freeze, and its distributed optimizer would
    keep moving frozen parameters: freeze_main is refused there, and without it the step hook only writes its
    notes."""
    rec = recipe("lemyx.freeze_main=true", device="cuda")
    rec = rec.replace(engine="megatron", train=rec.train.replace(engine="megatron"))
    check = config_checks(rec, H100)["freeze_main"]
    assert check.status == FAIL and check.hint == "--set lemyx.freeze_main=false"
    lemyx = Lemyx(FullIndexer(), Options(warmup_steps=1))
    fake = _Run(dataclasses.replace(Backends.reference(), indexer=lemyx))
    plugin.nam_before_step(step=0, run=fake)
    plugin.nam_before_step(step=1, run=fake)
    assert fake.notes[1].startswith("lemyx: step 1: indexer warm-up over after 1 steps")


# --- the CLI ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import json as json_mod
    import textwrap

    return prepare_corpus(tmp_path_factory, (json_mod, textwrap), chars=8000)


def test_nam_train_refuses_a_bad_option_before_making_a_run_folder(tmp_path, corpus, capsys):
    code = run(["train", "--plugins", "lemyx", "--set", "lemyx.backend=cuda-magic", "--max-steps", "1",
                "--data", str(corpus), "--run-dir", str(tmp_path / "run")])
    assert code == 2
    assert "--set lemyx.backend=cuda-magic: expected one of triton, reference" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_nam_train_with_index_cache_and_lemyx_trains_hands_over_and_the_loss_falls(tmp_path, corpus, capsys):
    """The issue's command: `nam train --plugins index-cache,lemyx --max-steps 40` (warm-up shortened to 20
    so both phases run; seq 32 keeps it quick)."""
    run_dir = tmp_path / "run"
    code = run(["train", "--plugins", "index-cache,lemyx", "--max-steps", "40", "--set", "lemyx.warmup_steps=20",
                "--set", "seq_len=32", "--data", str(corpus), "--run-dir", str(run_dir)])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 0, err
    log = (run_dir / "run.log").read_text()
    assert log.count("indexer warm-up over") == 1 and "[step 20] lemyx: step 20" in log
    assert "reference path" in log and "index-cache: FSSFSSFSS" in log
    assert log.index("index-cache: FSSFSSFSS") > log.index("indexer warm-up over")  # announced once it ran
    assert json.loads((run_dir / "plugins.json").read_text())["backends"]["indexer"] == "Lemyx"
    report = {line.split(":")[0]: line for line in json.loads((run_dir / "summary.json").read_text())["plugin_report"]}
    assert report["lemyx"] == "lemyx: dense warm-up until step 20, then 'index-cache' to step 40"
    assert report["index-cache"].startswith("index-cache: selected from step 21 to 40: ")
    assert report["index-cache"].endswith("top-k selections reused a Full layer's (67% of indexer work saved)")
    assert f"plugin {report['index-cache']}\n" in captured.out and f"plugin {report['lemyx']}\n" in captured.out
    metrics = read_metrics(run_dir)
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 40 and statistics.mean(losses[-5:]) < 0.8 * statistics.mean(losses[:5]), losses
    assert all(m["indexer_kl"] > 0 for m in metrics)
