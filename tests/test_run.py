"""The composition root: `nam train --dry-run` and `nam preflight` resolve and check a run through the same
call (nam56r.run), so preflight refuses exactly what training refuses, with the same exit code and message."""

import pytest

from nam_cli.main import run

REFUSALS = [
    # (flags, exit code, a fragment of the error)
    (["--recipe", "nam999"], 2, "unknown recipe 'nam999'"),
    (["--set", "hiden=128"], 2, "has no field 'hiden' (did you mean hidden?)"),
    (["--set", "ce_backend=liger-typo"], 3, "run: ce_backend: needs an active plugin providing ce 'liger-typo', "
                                            "found no installed plugin provides ce 'liger-typo'"),
    (["--set", "ce_backend=liger"], 3, "found provided by plugin 'liger', which is not requested"),
    (["--set", "indexer=index-cache"], 3, "found provided by plugin 'index-cache', which is not requested"),
    (["--set", "train.schedule=bogus-schedule"], 3, "needs an active plugin providing schedules 'bogus-schedule'"),
    (["--set", "train.schedule=1f1b"], 2, "train.schedule='1f1b' is a megatron-engine schedule"),
    (["--set", "train.moe_dispatcher=bogus"], 2, "train.moe_dispatcher='bogus': expected one of alltoall, flex"),
    (["--set", "train.moe_shared_expert_overlap=true", "--set", "train.overlap_grad_reduce=true"], 2,
     "train.overlap_grad_reduce=true, train.moe_shared_expert_overlap=true: megatron-engine settings"),
    (["--set", "train.grad_reduce_in_fp32=false"], 2, "which the local engine would not apply"),
    (["--tp", "2"], 2, "are megatron-engine options; the local engine runs one process"),
    (["--set", "train.ep=2"], 2, "are megatron-engine options; the local engine runs one process"),
    (["--engine", "megatron", "--device", "cuda", "--nproc", "2", "--ep", "4"], 2,
     "ep=4 must divide the data-parallel size 2"),
    (["--engine", "megatron"], 2, "the megatron engine runs on CUDA devices only"),
    (["--engine", "megatron", "--device", "cuda", "--tp", "2", "--nproc", "2"], 2,
     "cannot close these gaps of the lowering: tensor parallelism"),
    (["--plugins", "lemyx", "--set", "lemyx.warmup_steps=-1"], 2,
     "--set lemyx.warmup_steps=-1: expected an integer >= 0 (warmup_steps: optimizer steps of dense attention"),
    (["--plugins", "lemyx", "--set", "lemyx.warmup=5"], 2, "did you mean lemyx.warmup_steps?"),
    (["--set", "lemyx.warmup_steps=5"], 2, "'lemyx' is neither 'train' nor an active plugin"),
    (["--plugins", "liger,hopper-ce"], 2, "requested plugins select different values for 'ce_backend'"),
    (["--plugins", "no-such-plugin"], 3, "no-such-plugin: installed"),
    (["--plugins", "liger"], 3, "liger: CUDA device: needs a CUDA device"),
    (["--plugins", "index-cache", "--set", "index-cache.pattern=SSSSSSSSS"], 3, "index-cache: pattern"),
    (["--plugins", "dualpipev", "--set", "train.schedule=dualpipev"], 3, "dualpipev: engine"),
    (["--device", "cuda"], 3, "no CUDA device is visible"),
    (["--set", "hidden=16384"], 2, "the run cannot fit cpu"),
    (["--set", "compile_glue=true"], 2, "expected compile_glue with moe_backend=grouped"),
]


@pytest.mark.parametrize("flags, code, message", REFUSALS, ids=[" ".join(f) for f, _, _ in REFUSALS])
def test_preflight_refuses_exactly_what_train_refuses(flags, code, message, capsys, monkeypatch, tmp_path):
    import torch

    monkeypatch.delenv("NAM_PLUGINS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same refusals on a GPU host
    args = ["--recipe", "nam56r-tiny", *flags] if "--recipe" not in flags else flags
    assert run(["train", "--dry-run", "--run-dir", str(tmp_path / "run"), *args]) == code
    train_err = capsys.readouterr().err
    assert message in train_err
    assert run(["preflight", *args]) == code
    assert capsys.readouterr().err == train_err
    assert not (tmp_path / "run").exists()


def test_a_good_run_passes_both_and_preflight_shows_the_rows_the_host_writes(capsys, monkeypatch):
    import json

    monkeypatch.delenv("NAM_PLUGINS", raising=False)
    assert run(["train", "--dry-run", "--json", "--plugins", "index-cache,lemyx"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["backends"]["indexer"] == "Lemyx" and plan["plugins"] == ["reference", "index-cache", "lemyx"]
    assert run(["preflight", "--recipe", "nam56r-tiny", "--plugins", "index-cache,lemyx", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    selected = {c["plugin"]: (c["status"], c["found"]) for c in report["checks"] if c["check"] == "selected"}
    assert selected == {"reference": ("pass", "ssm_backend=reference, attention_backend=reference, "
                                              "indexer_kernels_backend=reference, ce_backend=reference, "
                                              "moe_backend=reference"),  # full is displaced: lemyx wraps index-cache
                        "index-cache": ("pass", "indexer_backend=index-cache"),
                        "lemyx": ("pass", "indexer_backend=lemyx")}


def test_a_hook_that_raises_is_one_failed_check_with_the_exception(tmp_path, monkeypatch):
    """The host's one error policy: no plugin wraps its self-test in try/except."""
    import dataclasses

    from nam_core.device import DeviceInfo
    from nam_core.host import PluginHost
    from nam_core.testing import fake_installed

    src = ("from nam_core import PluginInfo, hookimpl\nPLUGIN = PluginInfo(summary='x')\n"
           "@hookimpl\ndef nam_preflight(device, config):\n    raise RuntimeError('kernel did not compile')\n")
    host = PluginHost(installed=fake_installed(tmp_path, monkeypatch, {"boom": src}))
    real = dataclasses.replace(DeviceInfo.profile("h100"), profile_name=None)
    [fail] = host.evaluate(["boom"], real).failures
    assert fail.name == "launch check" and fail.found == "it raised RuntimeError: kernel did not compile"
