"""bench/activations.py on the CPU at toy width: the path the GPU run takes (one block per part, each recompute
choice, warm-up then measured), with the CPU's meter (saved tensors plus outputs, a lower count). What a choice
lowers is checked against ``nam56r.memory.RECOMPUTED_BY``, the table the plan reads the GPU's rows with."""

import json

import pytest
import torch

from nam56r.memory import RECOMPUTED_BY


@pytest.fixture(scope="module")
def bench(load_bench):
    return load_bench("activations")


@pytest.fixture(scope="module")
def parts(bench):
    from nam56r.model import Backends
    from nam56r.recipes import get_recipe

    cfg = get_recipe("nam56r-tiny").model.replace(seq_len=32)
    return bench.Parts(cfg, Backends.reference(), device="cpu", dtype=torch.float32)


def _kept(bench, parts, part, choice):
    return bench.measure(parts, part, choice, 2, device="cpu", dtype=torch.float32, meter=bench.SavedMeter())


@pytest.mark.parametrize("part", ["mamba", "moe", "mla", "mtp", "head"])
def test_a_choice_lowers_its_parts_and_leaves_the_others(bench, parts, part):
    none = _kept(bench, parts, part, "none")
    assert none["kept_bytes"] > 0 and none["backward_extra_bytes"] is None  # no peak on the CPU
    assert none["kept_bytes_per_token"] == none["kept_bytes"] / (2 * 32)
    other = "mamba" if part == "moe" else "moe"  # one choice that does not reach it (the slow test: every one)
    for choice in (*RECOMPUTED_BY[part], other):
        kept = _kept(bench, parts, part, choice)["kept_bytes"]
        if choice in RECOMPUTED_BY[part]:
            assert kept < none["kept_bytes"], (part, choice)
        else:
            assert kept == none["kept_bytes"], (part, choice)
    assert all(layer.recompute is None for layer in parts.layers.values())  # unmarked after each row


def test_rows_count_gradients_apart_from_the_shared_tables(bench, parts):
    """The MTP depth's row: its own parameters' gradients, and the embedding table and output head (used by the
    head and the embedding too) apart, as 2 tables of vocab x hidden."""
    row = _kept(bench, parts, "mtp", "none")
    cfg = parts.cfg
    assert row["shared_grad_bytes"] == 2 * cfg.vocab_size * cfg.hidden * 4  # float32
    assert row["grad_bytes"] == 4 * sum(p.numel() for p in parts.mtp.parameters())


@pytest.mark.slow
def test_the_command_writes_every_part_and_choice(bench, tmp_path, monkeypatch):
    out = tmp_path / "a.json"
    monkeypatch.setattr("sys.argv", ["activations.py", "--recipe", "nam56r-tiny", "--device", "cpu", "--batch", "2",
                                     "--set", "seq_len=32", "--json", str(out)])
    assert bench.main() == 0
    data = json.loads(out.read_text())
    assert data["meta"]["meter"].startswith("saved tensors") and data["meta"]["shape"]["seq_len"] == 32
    assert {(r["part"], r["choice"]) for r in data["rows"]} == {(p, c) for p in bench.PARTS for c in bench.CHOICES}
    kept = {(r["part"], r["choice"]): r["kept_bytes"] for r in data["rows"]}
    for part, choice in kept:
        if choice != "none":
            reaches = choice in RECOMPUTED_BY[part]
            assert (kept[part, choice] < kept[part, "none"]) if reaches else (kept[part, choice] == kept[part, "none"])
    from nam56r.memory import constants_from

    with pytest.raises(ValueError, match="on a GPU"):  # CPU rows are never constants
        constants_from(data)
