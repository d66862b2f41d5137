"""bench/numerics_loss.py and bench/megatron.py's numerics and recompute rows on CPU: the verdict's band, the
run matrix, and two real toy runs through `nam train` (so the GPU command does not break on a typo)."""

import json
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("numerics_loss")


def test_verdict_band_is_the_seed_gap_at_least_band(bench):
    flat = lambda x: [x] * 40  # noqa: E731
    curves = {"fp32-master": flat(2.0), "fp32-master, seed+1": flat(2.05), "bf16": flat(2.2),
              "stochastic-rounding": flat(2.01)}
    v = bench.verdict(curves, last=30)
    assert v["half_width"] == pytest.approx(0.05) and v["band"] == pytest.approx([1.95, 2.05])
    assert v["inside"] == {"fp32-master": True, "fp32-master, seed+1": True, "bf16": False,
                           "stochastic-rounding": True}
    tight = bench.verdict({"fp32-master": flat(2.0), "fp32-master, seed+1": flat(2.0), "bf16": flat(2.015)})
    assert tight["half_width"] == bench.BAND and tight["inside"]["bf16"]
    assert any("| bf16 | 2.2000 | +0.2000 | NO |" == line for line in bench.table(v))


def test_two_toy_runs_on_the_cpu(bench, tmp_path, capsys):
    out = tmp_path / "n.json"
    code = bench.main(["--device", "cpu", "--steps", "2", "--runs", "bf16", "--set", "seq_len=32",
                       "--set", "num_layers=8", "--set", "mla_attention_ranks=0", "--set", "train.micro_batch_size=1",
                       "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["curves"]) == {"fp32-master", "bf16"} and all(len(c) == 2 for c in result["curves"].values())
    assert "train.optimizer_numerics=bf16" in result["runs"]["bf16"]
    assert "| fp32-master |" in capsys.readouterr().out


def test_throughput_rows_per_numerics_and_recompute(load_bench):
    mega = load_bench("megatron")
    args = SimpleNamespace(numerics=["fp32-master", "stochastic-rounding"], recompute=["none", "mamba,moe"],
                           engines=["local", "megatron"], float8=["none"], gpus=[1], overlap=["none"], te=["none"],
                           te_experts=["nam"])
    runs = mega.throughput_runs(args)
    assert ("local", 1, "none", "none", "stochastic-rounding", "mamba,moe", ("none", "nam")) in runs
    assert ("megatron", 1, "none", "none", "fp32-master", "mamba,moe", ("none", "nam")) in runs
    assert not [r for r in runs if r[0] == "megatron" and r[4] == "stochastic-rounding"]  # refused by Megatron
    assert len(runs) == 6
    assert mega.RECOMPUTE_CHOICES["mamba,moe"] == ("mamba", "moe")


def test_a_throughput_rows_train_config_reaches_the_composition_root(load_bench):
    """The worker's train config (from the row's JSON spec) as ``--set`` overrides: the recompute tuple as a comma
    list, the numerics by name; the resolved spec carries both."""
    from nam56r.run import resolve
    from nam_core.engine.config import TrainConfig

    mega = load_bench("megatron")
    train = TrainConfig(dtype="bfloat16", device="cuda", recompute=("mamba", "moe"), optimizer_numerics="bf16-moments")
    spec = resolve(mega.request_for({"recipe": "nam56r", "model": {}, "backends": "reference"}, train)).spec
    assert spec.train.recompute == ("mamba", "moe") and spec.train.optimizer_numerics == "bf16-moments"
