"""``nam train --dry-run``: a plan a person reads (and ``--json`` for scripts), and ``--device-profile`` planning a
GPU run on a machine without that GPU: the full plan and the memory estimate, no CUDA asked, nothing written."""

import json

import pytest

from nam_cli.main import run


@pytest.fixture
def no_cuda(monkeypatch):
    """Any question to CUDA fails the test: a plan against a profile must not ask the machine."""
    import torch

    def asked(*args, **kwargs):
        raise AssertionError("the plan asked CUDA")

    monkeypatch.delenv("NAM_PLUGINS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name in ("is_available", "get_device_properties", "device_count"):
        monkeypatch.setattr(torch.cuda, name, asked)


def plan_json(capsys, *flags) -> dict:
    assert run(["train", "--dry-run", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_is_sections_a_person_reads(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("NAM_PLUGINS", raising=False)
    assert run(["train", "--dry-run", "--run-dir", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    for line in ("plan: nam train --recipe nam56r-tiny --engine local", "device: cpu, checked on this machine",
                 "layers: 52 (4 mla, 9 dsa, 17 mamba, 22 moe) + 2 MTP depths",
                 "parameters: 3.6M total (3,638,848)", "ssm: reference (plugin reference) -> ReferenceSSMScan",
                 f"would write: run folder {tmp_path / 'run'}/", "checkpoints/  every 20 steps and at the end"):
        assert line in text, line
    assert "{'" not in text  # not a Python dict
    assert not (tmp_path / "run").exists()


def test_the_json_plan_carries_the_model_numbers(capsys, monkeypatch):
    from nam56r.flops import flops_per_token
    from nam56r.model import count_parameters
    from nam56r.recipes import get_recipe

    monkeypatch.delenv("NAM_PLUGINS", raising=False)
    cfg = get_recipe("nam56r-tiny").model
    plan = plan_json(capsys)
    assert plan["parameters"] == count_parameters(cfg) and plan["flops_per_token"] == flops_per_token(cfg).total
    assert plan["layers_by_kind"] == {"mla": 4, "dsa": 9, "mamba": 17, "moe": 22}
    assert plan["tokens_per_step"] == 4 * 64  # micro-batch 4 x seq_len 64
    assert plan["memory"]["static_gib"] == pytest.approx(4 * 4 * plan["parameters"]["total"] / 2**30)  # fp32 x 4
    assert plan["checked_on_hardware"] and plan["device_profile"] is None


def test_nam56r_planned_against_h200_without_a_gpu(capsys, no_cuda, tmp_path, monkeypatch):
    assert run(["train", "--recipe", "nam56r", "--dry-run", "--device-profile", "h200",
                "--run-dir", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "NVIDIA H200 sm_90 (profile h200): planned against the profile's description, not checked on " \
           "hardware" in text
    assert "parameters: 4.73B total" in text and "memory (one process holds everything, in bfloat16)" in text
    assert "ssm: mamba-ssm (plugin mamba-ssm)" in text
    assert "  by part; activations: kept at micro-batch 1 under the recompute shown:" in text
    assert "    mamba       2.31B params: weights   4.3 GiB, grads   4.3 GiB, optimizer  25.9 GiB, activations" in text
    assert "fits in 139.8 GiB; largest micro-batch that fits: 3" in text  # fp32-master, no recompute
    assert not (tmp_path / "run").exists()
    # the kernel caches where the run will put them: inductor's too, in nam's folder (importing torch._inductor,
    # as the plan does, sets TORCHINDUCTOR_CACHE_DIR to torch's /tmp default; the run points it at nam's first)
    from nam_core import cache

    monkeypatch.setattr(cache, "_AT_START", dict.fromkeys(cache.KERNEL_CACHES))  # none set by the user
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_someone")
    assert run(["train", "--recipe", "nam56r", "--dry-run", "--device-profile", "h200"]) == 0
    caches = ", ".join(str(cache.cache_dir() / sub) for sub in ("tilelang", "triton", "inductor"))
    assert f"kernel caches: {caches} (compiled once per shape, reused)" in capsys.readouterr().out


def test_nam56r_on_an_h100_does_not_fit_and_the_plan_says_what_that_means(capsys, no_cuda, tmp_path):
    """Above the lower bound a start refuses, the measured plan may still say it does not fit: exit 0 with the
    verdict, no micro-batch named as fitting, and a line that says a start would not be refused."""
    assert run(["train", "--recipe", "nam56r", "--dry-run", "--device-profile", "h100",
                "--run-dir", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "does NOT fit in 79.2 GiB; largest micro-batch that fits: none" in text
    assert "a start is refused only below the lower bound" in text


def test_megatron_at_ep8_on_h200_gets_the_memory_estimate(capsys, no_cuda):
    from nam56r.memory import largest_mbs, megatron_estimate, parameter_split
    from nam56r.recipes import get_recipe

    plan = plan_json(capsys, "--recipe", "nam56r", "--device-profile", "h200", "--engine", "megatron",
                     "--nproc", "8", "--ep", "8")
    cfg = get_recipe("nam56r").model
    split = parameter_split(cfg)
    mem = plan["memory"]
    assert mem["total_gib"] == pytest.approx(megatron_estimate(cfg, world=8, ep=8, mbs=1, kinds=(), split=split)[0].total_gib)
    assert mem["fits"] is True and mem["largest_micro_batch"] == largest_mbs(cfg, world=8, ep=8, capacity_gib=139.8)
    assert plan["megatron"]["world_size"] == 8 and plan["megatron"]["ep"] == 8 and plan["megatron"]["dp"] == 8
    assert plan["tokens_per_step"] == 8 * 4096 and plan["device_profile"] == "h200"
    assert not plan["checked_on_hardware"]


@pytest.mark.parametrize("flags, code, message", [
    (["--device-profile", "h200"], 2, "--device-profile h200 plans a run against a described device; training "
                                      "needs the real one, found no --dry-run"),
    (["--dry-run", "--device-profile", "h200"], 2, "describes a cuda device, but this run trains on "
                                                   "train.device=cpu"),
    (["--dry-run", "--device-profile", "tpu"], 2, "unknown device profile 'tpu'"),
    # Requirements are evaluated against the profile: GB10's 99 KiB of shared memory per block is too little.
    (["--dry-run", "--recipe", "nam56r", "--device-profile", "gb10"], 3,
     "mamba-ssm: shared memory per block: needs >= 223,904 B"),
])
def test_profile_refusals(flags, code, message, capsys, no_cuda, tmp_path):
    assert run(["train", "--run-dir", str(tmp_path / "run"), *flags]) == code
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_plan_shows_numerics_recompute_and_activations_by_kind(capsys, no_cuda):
    """--dry-run says which numerics and recompute the run uses and, per part, the weights, gradients, optimizer
    states and kept activations under them: the megatron plan at EP 8 is the one bench/megatron.py memory measures
    against; recompute lowers the parts it reaches and only those."""
    from nam56r import memory
    from nam56r.recipes import get_recipe

    flags = ("--recipe", "nam56r", "--device-profile", "h200", "--engine", "megatron", "--nproc", "8", "--ep", "8",
             "--set", "train.micro_batch_size=8")
    mem = plan_json(capsys, *flags, "--set", "train.recompute=mamba,moe")["memory"]
    none = plan_json(capsys, *flags)["memory"]
    assert mem["numerics"].startswith("fp32-master") and mem["recompute"] == ["mamba", "moe"]
    rows, by_part = mem["activations_by_kind"], mem["by_part"]
    assert {p for p, r in rows.items() if r["recomputed"]} == {"mamba", "moe"}
    for part in memory.PARTS:
        lowered = by_part[part]["activations_gib"] < none["by_part"][part]["activations_gib"]
        assert lowered == (part in ("mamba", "moe")), part
        assert by_part[part]["optimizer_gib"] == none["by_part"][part]["optimizer_gib"]
    assert sum(r["weights_gib"] for r in by_part.values()) == pytest.approx(mem["weights_gib"])
    assert sum(r["optimizer_gib"] for r in by_part.values()) == pytest.approx(mem["optimizer_gib"])
    assert sum(r["activations_gib"] for r in by_part.values()) == pytest.approx(
        memory.backward_peak(get_recipe("nam56r").model, ("mamba", "moe"), 8, grads=False)["activations_gib"])
    same, _ = memory.megatron_estimate(get_recipe("nam56r").model, world=8, ep=8, mbs=8, kinds=("mamba", "moe"))
    assert mem["total_gib"] == same.total_gib  # what bench/megatron.py memory compares its measured peak with
    assert mem["one_gpu_check"] == ("python bench/megatron.py memory --world 8 --ep 8 --mbs 8 --recompute mamba,moe "
                                    "--numerics fp32-master")
    assert none["total_gib"] > mem["total_gib"]
    assert mem["fits"] is True and none["fits"] is False  # the 8x H200 target: MBS 8 with mamba,moe
    scan = plan_json(capsys, "--recipe", "nam56r", "--device-profile", "h200", "--set", "train.micro_batch_size=4",
                     "--set", "train.recompute=mamba-scan")["memory"]
    assert scan["fits"] is True  # it ran on one H200 (bench/results/profiles); the earlier estimate said it did not
    local = plan_json(capsys, "--recipe", "nam56r", "--device-profile", "h200", "--set", "train.micro_batch_size=4",
                      "--set", "train.recompute=mamba")["memory"]
    assert local["optimizer_gib"] == pytest.approx(12 / 2 * local["weights_gib"])  # fp32 masters + fp32 moments


@pytest.mark.parametrize("flags", [
    ("--set", "train.recompute=mamba-scan"),
    ("--set", "train.recompute=mamba", "--set", "train.optimizer_numerics=bf16"),
    ("--engine", "megatron", "--nproc", "8", "--ep", "8", "--set", "train.recompute=mamba,moe"),
    ("--engine", "megatron", "--nproc", "4", "--ep", "4"),
])
def test_the_largest_micro_batch_fits_one_more_does_not_and_check_fits_agrees(capsys, no_cuda, flags):
    """The dry-run's largest micro-batch L: its plan fits, L + 1's does not (the same plan, asked at L + 1), and
    ``check_fits`` (the lower bound training is refused by) lets every micro-batch up to L through."""
    from nam56r import memory
    from nam56r.run import RunRequest, resolve
    from nam_core.device import DeviceInfo

    base = ("--recipe", "nam56r", "--device-profile", "h200", *flags)
    largest = plan_json(capsys, *base)["memory"]["largest_micro_batch"]
    assert 1 <= largest < memory.MAX_MBS
    at = plan_json(capsys, *base, "--set", f"train.micro_batch_size={largest}")["memory"]
    over = plan_json(capsys, *base, "--set", f"train.micro_batch_size={largest + 1}")["memory"]
    assert at["fits"] is True and at["largest_micro_batch"] == largest
    assert over["fits"] is False and over["total_gib"] > at["total_gib"]
    engine = "megatron" if "megatron" in flags else "local"
    sets = [flags[i + 1] for i, f in enumerate(flags) if f == "--set"]
    nproc = int(flags[flags.index("--nproc") + 1]) if "--nproc" in flags else None
    ep = int(flags[flags.index("--ep") + 1]) if "--ep" in flags else None
    for mbs in (1, largest):
        run = resolve(RunRequest(recipe="nam56r", overrides=[*sets, f"train.micro_batch_size={mbs}"], engine=engine,
                                 nproc=nproc, ep=ep, env_plugins=False))
        checked = memory.check_fits(run.spec, DeviceInfo.profile("h200"))
        assert checked["static_gib"] + checked["activations_gib"] <= at["total_gib"]  # a bound below the plan
