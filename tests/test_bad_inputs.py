"""Bad input to ``nam train``: every one is refused with its exit code and a message naming the field or the
file, before anything is written (no run folder, no temp folder).

Each case fails while the run is resolved (a config value, exit 2), its plugins activated (exit 3) or its
data opened (exit 4), so none builds a model; ``--max-steps 1`` bounds a case that would wrongly pass.
"""

from __future__ import annotations

import json

import pytest

from nam56r.testing import prepare_corpus
from nam_cli.main import run

# (flags, exit code, fragments the error must hold). In flags, {name} is a dataset folder of the ``data``
# fixture; without --data, the good dataset is used.
CASES = [
    # --- values out of range: train.* ---------------------------------------------------------------
    (["--seed", "-1"], 2, ["train.seed=-1: expected an integer in [0, 4294967295]", "hint: --seed 1234"]),
    (["--set", "train.lr=-1"], 2, ["train.lr=-1.0: expected a finite number > 0", "--set train.lr=0.003"]),
    (["--set", "train.lr=nan"], 2, ["train.lr=nan: expected a finite number > 0"]),
    (["--set", "train.lr=inf"], 2, ["train.lr=inf: expected a finite number > 0"]),
    (["--set", "train.lr=0"], 2, ["train.lr=0.0: expected a finite number > 0"]),
    (["--set", "train.dtype=float8"], 2, ["train.dtype='float8': expected one of float32, bfloat16"]),
    (["--set", "train.micro_batch_size=0"], 2, ["train.micro_batch_size=0: expected an integer >= 1"]),
    (["--set", "train.grad_accum=0"], 2, ["train.grad_accum=0: expected an integer >= 1"]),
    (["--set", "train.log_every=0"], 2, ["train.log_every=0: expected an integer >= 1"]),
    (["--set", "train.warmup_steps=-1"], 2, ["train.warmup_steps=-1: expected an integer >= 0"]),
    (["--set", "train.total_steps=0"], 2, ["train.total_steps=0: expected an integer >= 1"]),
    (["--set", "train.adam_beta1=1"], 2, ["train.adam_beta1=1.0: expected a finite number in [0, 1)"]),
    (["--set", "train.adam_beta2=-0.1"], 2, ["train.adam_beta2=-0.1: expected a finite number in [0, 1)"]),
    (["--set", "train.adam_eps=0"], 2, ["train.adam_eps=0.0: expected a finite number > 0"]),
    (["--set", "train.grad_clip=-1"], 2, ["train.grad_clip=-1.0: expected a finite number >= 0 (0 disables)"]),
    (["--set", "train.weight_decay=nan"], 2, ["train.weight_decay=nan: expected a finite number >= 0"]),
    (["--set", "train.min_lr_ratio=2"], 2, ["train.min_lr_ratio=2.0: expected a finite number in [0, 1]"]),
    (["--set", "train.keep_checkpoints=0"], 2, ["train.keep_checkpoints=0: expected an integer >= 1"]),
    (["--set", "train.checkpoint_every=-1"], 2, ["train.checkpoint_every=-1: expected an integer >= 0 "
                                                 "(0: no checkpoints)"]),
    (["--set", "train.moe_dispatcher=bogus"], 2, ["train.moe_dispatcher='bogus': expected one of alltoall, flex"]),
    (["--device", "tpu"], 2, ["train.device='tpu': expected one of cpu, cuda", "hint: --device cpu"]),
    (["--tp", "0"], 2, ["train.tp=0: expected an integer >= 1", "hint: --tp 1"]),
    (["--max-steps", "0"], 2, ["--max-steps must be >= 1, found 0"]),
    (["--set", "train.lr=-1", "--set", "hidden=0"], 2, ["2 problems with the config", "hidden=0", "train.lr=-1.0"]),
    # --- values out of range: the model -------------------------------------------------------------
    (["--set", "hidden=-64"], 2, ["hidden=-64: expected an integer >= 1", "hint: --set hidden=64"]),
    (["--set", "hidden=0"], 2, ["hidden=0: expected an integer >= 1"]),
    (["--set", "num_experts=0"], 2, ["num_experts=0: expected an integer >= 1"]),
    (["--set", "attn_heads=0"], 2, ["attn_heads=0: expected an integer >= 1"]),
    (["--set", "seq_len=0"], 2, ["seq_len=0: expected an integer >= 1"]),
    (["--set", "vocab_size=-1"], 2, ["vocab_size=-1: expected an integer >= 1"]),
    (["--set", "norm_eps=0"], 2, ["norm_eps=0.0: expected a finite number > 0"]),
    (["--set", "init_std=nan"], 2, ["init_std=nan: expected a finite number > 0"]),
    (["--set", "qk_rope_dim=7"], 2, ["qk_rope_dim=7: expected an integer >= 2 and a multiple of 2"]),
    (["--set", "mamba_rope_fraction=0.3"], 2, ["mamba_rope_fraction=0.3: expected one of 0.5, 1.0"]),
    (["--set", "ngram_orders=0,2"], 2, ["ngram_orders=0,2: expected a list of integers, each >= 1"]),
    # --- fields that disagree with each other --------------------------------------------------------
    (["--set", "moe_topk=17"], 2, ["moe_topk=17, num_experts=16: expected moe_topk <= num_experts",
                                   "hint: --set moe_topk=4"]),
    (["--set", "hidden=60"], 2, ["mamba_expand * hidden divisible by mamba_headdim", "hint: --set hidden=64"]),
    (["--set", "mamba_dt_min=1"], 2, ["mamba_dt_min=1.0, mamba_dt_max=0.1: expected mamba_dt_min <= mamba_dt_max"]),
    (["--set", "structure_vocab=3"], 2, ["structure_vocab=3: expected structure_vocab >= the structure ids"]),
    (["--set", "pattern=*X*"], 2, ["layer pattern '*X*', position 1: unknown symbol 'X'"]),
    (["--set", "mla_attention_ranks=0,99"], 2, ["mla_attention_ranks [0, 99] name slots [99]"]),
    # --- values too big to build: refused by the memory plan (nam56r/memory.py) before anything exists -----
    *[(["--set", f"{field}={value}", *dry], 2, ["the run cannot fit ", f"{label} {value}" if label else "GiB",
                                               "nothing was written", "hint: lower the sizes"])
      for field, value, label in (("hidden", 10**9, "hidden"), ("num_layers", 10**9, "num_layers"),
                                  ("vocab_size", 10**12, "vocab_size"), ("seq_len", 10**9, "seq_len"),
                                  ("train.micro_batch_size", 10**8, "micro-batch"),
                                  ("num_experts", 10**9, ""), ("moe_ffn_hidden", 10**9, ""),
                                  ("attn_heads", 10**9, ""), ("d_state", 10**9, ""))
      for dry in ([], ["--dry-run"])],
    (["--set", "hidden=1000000000", "--dry-run", "--device-profile", "h200"], 2, ["the run cannot fit "]),
    # --- keys: misspelled, misplaced, malformed -----------------------------------------------------
    (["--set", "train.learning_rate=1e-3"], 2, ["TrainConfig has no field 'learning_rate' (did you mean train.lr?)"]),
    (["--set", "lr=1e-3"], 2, ["the model config has no field 'lr' (did you mean train.lr?)"]),
    (["--set", "train.hidden=128"], 2, ["TrainConfig has no field 'hidden' (did you mean hidden?)"]),
    (["--set", "hiden=128"], 2, ["the model config has no field 'hiden' (did you mean hidden?)"]),
    (["--set", "tarin.lr=1"], 2, ["'tarin' is neither 'train' nor an active plugin (did you mean train.lr?)"]),
    (["--set", "hidden"], 2, ["--set 'hidden': expected KEY=VALUE"]),
    (["--set", "hidden=wide"], 2, ["--set hidden=wide: expected int"]),
    # --- recipe, engine, layout, plugins ------------------------------------------------------------
    (["--recipe", "nam999"], 2, ["unknown recipe 'nam999'; known: nam56r, nam56r-small, nam56r-tiny"]),
    (["--engine", "deepspeed"], 2, ["--engine 'deepspeed': expected local or megatron"]),
    (["--tp", "2"], 2, ["a parallel layout (--tp, --pp, --ep, train.tp/pp/ep) are megatron-engine options"]),
    (["--plugins", "flash-attn"], 3, ["flash-attn: installed", "'flash-attn' is not a nam plugin known here",
                                      "`nam plugins list`"]),
    (["--plugins", "ligr"], 3, ["ligr: installed", "did you mean liger?"]),
    (["--plugins", "lemyx", "--set", "lemyx.warmup=5"], 2, ["plugin 'lemyx' has no option 'warmup' "
                                                           "(did you mean lemyx.warmup_steps?)"]),
    (["--plugins", "lemyx", "--set", "lemyx.warmup_steps=-1"], 2, ["--set lemyx.warmup_steps=-1: expected an "
                                                                  "integer >= 0"]),
    # --- data ----------------------------------------------------------------------------------------
    (["--data", "{missing}"], 4, ["no prepared dataset at {missing}: the folder does not exist"]),
    (["--data", "{file}"], 4, ["{file} is a file; a prepared dataset is a folder"]),
    (["--data", "{empty}"], 4, ["no prepared dataset at {empty}: the folder has no dataset.json manifest"]),
    (["--data", "{bad_json}"], 4, ["{bad_json}/dataset.json is not a readable JSON manifest"]),
    (["--data", "{bad_field}"], 4, ["{bad_field}/dataset.json: field 'tokens' is 'many'; expected a JSON integer"]),
    (["--data", "{flipped}"], 4, ["{flipped}/tokens.bin is corrupt or was changed since it was prepared"]),
    (["--data", "{old}"], 4, ["{old} was prepared by an older nam", "nam data checksum {old}"]),
    (["--set", "vocab_size=100"], 4, ["holds token id 256 but the model's vocabulary has 100 ids"]),
    (["--data", "{void_dtype}"], 4, ["{void_dtype}/dataset.json: dtype 'V2' is not an integer dtype"]),
    (["--data", "{eod_beyond}"], 4, ["{eod_beyond}/dataset.json: tokenizer.eod is 300, outside the tokenizer's "
                                     "vocabulary (vocab_size 257"]),
    (["--data", "{eod_model}", "--set", "vocab_size=257"], 4, ["tokenizer.eod is 299 but the model's vocabulary "
                                                               "has 257 ids"]),
]


def _case_id(case) -> str:
    return " ".join(case[0])


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A good prepared dataset, and bad ones made from copies of it."""
    import inspect
    import shutil
    import textwrap

    good = prepare_corpus(tmp_path_factory, (textwrap, inspect), chars=4000)
    root = tmp_path_factory.mktemp("bad-data")

    def copy(name: str):
        shutil.copytree(good, root / name)
        return root / name

    (root / "file").write_text("not a dataset\n")
    (root / "empty").mkdir()
    (copy("bad_json") / "dataset.json").write_text("{not json")
    manifest = json.loads((good / "dataset.json").read_text())
    (copy("bad_field") / "dataset.json").write_text(json.dumps({**manifest, "tokens": "many"}))
    flipped = copy("flipped") / "tokens.bin"
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # same size, one id changed
    flipped.write_bytes(bytes(raw))
    old = {**manifest, "sha256": {k: v for k, v in manifest["sha256"].items() if not k.endswith(".bin")}}
    (copy("old") / "dataset.json").write_text(json.dumps(old))
    (root / "old" / ".nam-verified.json").unlink()
    (copy("void_dtype") / "dataset.json").write_text(json.dumps({**manifest, "token_dtype": "V2"}))
    tokenizer = manifest["tokenizer"]
    (copy("eod_beyond") / "dataset.json").write_text(json.dumps({**manifest, "tokenizer": {**tokenizer, "eod": 300}}))
    (copy("eod_model") / "dataset.json").write_text(json.dumps(
        {**manifest, "tokenizer": {**tokenizer, "eod": 299, "vocab_size": 300}}))
    return {"void_dtype": root / "void_dtype", "eod_beyond": root / "eod_beyond", "eod_model": root / "eod_model",
            "good": good, "missing": root / "missing", "file": root / "file", "empty": root / "empty",
            "bad_json": root / "bad_json", "bad_field": root / "bad_field", "flipped": root / "flipped",
            "old": root / "old"}


def test_there_are_at_least_forty_cases():
    assert len(CASES) >= 40


def test_a_float_plugin_option_refuses_nan_and_inf():
    """nan passes every min/max comparison, so the bound alone would let it through."""
    from nam_core.errors import ConfigError
    from nam_core.options import Option

    option = Option("ratio", float, 0.5, "a share", min=0.0, max=1.0)
    assert option.parse("p", "0.25") == 0.25
    for raw in ("nan", "inf"):
        with pytest.raises(ConfigError, match=rf"--set p.ratio={raw}: expected a finite number in \[0.0, 1.0\]"):
            option.parse("p", raw)


@pytest.mark.parametrize("flags, code, fragments", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_is_refused_with_its_exit_code_and_leaves_nothing(flags, code, fragments, data, tmp_path,
                                                                    capsys, monkeypatch):
    monkeypatch.delenv("NAM_PLUGINS", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("NAM_CACHE_DIR", str(tmp_path / "cache"))
    paths = {k: str(v) for k, v in data.items()}
    flags = [f.format(**paths) for f in flags]
    if "--data" not in flags:
        flags += ["--data", paths["good"]]
    run_dir = tmp_path / "run"
    before = sorted(p.name for p in tmp_path.iterdir())

    assert run(["train", "--run-dir", str(run_dir), "--max-steps", "1", "--quiet", *flags]) == code
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment.format(**paths) in err
    assert "Traceback" not in err
    assert "pip install nam-plugin-" not in err  # never a guessed package name
    assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no cache, no temp folder, nothing
    assert not [p for folder in (data["good"].parent, data["file"].parent) for p in folder.rglob("*")
                if ".tmp-" in p.name]


@pytest.mark.parametrize("argv", [
    ["data", "prepare", "{src}", "--out", "/proc/nam-test-output"],
    ["train", "--run-dir", "/proc/nam-test-run", "--max-steps", "1", "-q"],
])
def test_an_output_path_that_cannot_be_made_is_one_error_naming_it_exit_6(argv, tmp_path, capsys):
    """A path a person fixes on the filesystem (here one under /proc, where no folder can be made) is one error
    block with the path, not a traceback; an OSError without a path stays a traceback (a bug)."""
    from nam_cli.main import _path_error

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n" * 50)
    assert run([a.format(src=src) for a in argv]) == 6
    err = capsys.readouterr().err
    assert "cannot use /proc/nam-test-" in err and "Traceback" not in err, err
    assert _path_error(OSError(5, "Input/output error")) is None


@pytest.mark.parametrize("case", ["data", "run-dir"])
def test_a_dry_run_refuses_missing_data_and_a_file_as_run_folder_as_a_start_does(case, tmp_path, capsys):
    """The plan named data that is not there and a run folder that cannot be one, exit 0; a start refuses both
    before writing (4 and 6): the dry run now does too, with the same words."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    flags = ["--data", str(tmp_path / "nowhere"), "--run-dir", str(tmp_path / "run")] if case == "data" else \
        ["--run-dir", str(blocker)]
    codes, errors = [], []
    for dry in (["--dry-run"], []):
        codes.append(run(["train", "--max-steps", "1", "-q", *flags, *dry]))
        errors.append(capsys.readouterr().err)
    assert codes == [4, 4] if case == "data" else codes == [6, 6]
    assert errors[0] == errors[1] and "error: " in errors[0], errors
    assert not (tmp_path / "run").exists()
