"""Exported weights: a trained NAM56R as safetensors + a config JSON (+ its tokenizer), loadable with nam56r alone.

An export folder (``nam export``, cli/export.py)::

    model.safetensors      every tensor of ``NAM56R.state_dict()`` under nam56r's names, in the dtype it was
                           trained in (float32 or bfloat16; D and dt_bias stay float32)
    config.json            {"format": "nam56r-export", "version": 1, "model": <NAM56RConfig fields>,
                            "dtype": ..., "step": ..., "source": {...}, "sha256": {"model.safetensors": ...}}
    optimizer.safetensors  only with ``nam export --with-optimizer``: AdamW's state under nam56r's parameter names,
                           ``exp_avg/<name>`` and ``exp_avg_sq/<name>`` (each in the dtype it was kept in) and,
                           for a bf16 model with fp32 masters, ``master/<name>`` (fp32); config.json's
                           "optimizer" then holds {"step": AdamW's step count, "numerics": train.optimizer_numerics,
                           "dtype": train.dtype} and its sha256 the file's
    tokenizer/             nam.json, the tokenizer's description (``nam_core.data.tokenizer``: kind, vocabulary
                           size, eod id), and tokenizer.json, the Hugging Face file itself when the data was
                           prepared with one (byte-level data needs no file: ids 0..255 are the bytes, 256 is eod)

safetensors holds raw tensor bytes and a JSON header, nothing executable, so loading one runs no code from the
file (unlike a pickle). ``load`` checks the file's sha256 against config.json, builds the model from the config
and loads the tensors with ``strict=True``: a missing or extra tensor is an error, and every value is the
checkpoint's bit for bit (tests/test_export.py).

``safetensors`` is an optional package (nam's ``export`` extra); without it both directions are a ConfigError
that names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Mapping

import torch

from nam56r.config import NAM56RConfig
from nam_core.errors import ConfigError, NamError

FORMAT, VERSION = "nam56r-export", 1
WEIGHTS, CONFIG, TOKENIZER, OPTIMIZER = "model.safetensors", "config.json", "tokenizer", "optimizer.safetensors"
MOMENTS = ("exp_avg", "exp_avg_sq")


def safetensors_torch():
    """``safetensors.torch``, or a ConfigError that says how to install it (never a silent other format)."""
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError("exporting or loading safetensors weights needs the 'safetensors' package, which is "
                          "not installed",
                          hint="pip install safetensors  (or, from a nam checkout: pip install -e '.[export]')") from None
    return safetensors.torch


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@dataclasses.dataclass
class ExportedOptimizer:
    """AdamW's state as an export carries it: ``state[name]`` holds ``exp_avg``, ``exp_avg_sq`` and, for a bf16
    model with fp32 masters, ``master`` (fp32), for every trainable parameter of nam56r by its name; ``step``:
    AdamW's step count (the checkpoint's training step: every step of either engine steps every parameter);
    ``numerics``/``dtype``: the run's ``train.optimizer_numerics`` and ``train.dtype``, which a run that takes
    the state must have."""

    step: int
    numerics: str
    dtype: str
    state: Mapping[str, dict[str, torch.Tensor]]

    def describe(self) -> str:
        return f"AdamW step {self.step}, {self.numerics}, {self.dtype}"


def write(out: Path, state: Mapping[str, torch.Tensor], cfg: NAM56RConfig, *, step: int, source: dict,
          tokenizer: dict | None = None, tokenizer_file: Path | None = None, overwrite: bool = False,
          optimizer: ExportedOptimizer | None = None) -> Path:
    """Write an export folder at ``out`` (beside it as ``.<name>.tmp-<pid>``, renamed into place: a folder
    named ``out`` with a config.json is complete). ``state``: the model's state dict (tied or shared tensors
    are written as separate copies: safetensors stores no aliasing); ``optimizer``: AdamW's state too."""
    st = safetensors_torch()
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{out} exists and is not empty", hint="choose another --out, or pass --overwrite")
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in tensors.values() if v.is_floating_point()})
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (tmp / TOKENIZER).mkdir(parents=True)
        st.save_file(tensors, str(tmp / WEIGHTS), metadata={"format": FORMAT})
        if tokenizer is not None:
            (tmp / TOKENIZER / "nam.json").write_text(json.dumps(tokenizer, indent=2) + "\n")
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER / "tokenizer.json")
        config = {"format": FORMAT, "version": VERSION, "model": dataclasses.asdict(cfg), "dtypes": dtypes,
                  "step": step, "source": source, "sha256": {WEIGHTS: _sha256(tmp / WEIGHTS)}}
        if optimizer is not None:
            flat = {f"{kind}/{name}": t.detach().to("cpu").contiguous()  # no copy: the export owns these
                    for name, kinds in optimizer.state.items() for kind, t in kinds.items()}
            st.save_file(flat, str(tmp / OPTIMIZER), metadata={"format": FORMAT})
            config["optimizer"] = {"step": optimizer.step, "numerics": optimizer.numerics, "dtype": optimizer.dtype}
            config["sha256"][OPTIMIZER] = _sha256(tmp / OPTIMIZER)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_config(folder: Path) -> tuple[NAM56RConfig, dict]:
    """The model config of an export folder and the whole config.json; NamError when it is not one."""
    path = Path(folder) / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise NamError(f"{folder} is not a nam56r export (its {CONFIG} cannot be read: {e})",
                       hint="point at a folder written by `nam export`") from None
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise NamError(f"{path}: format {config.get('format')!r} version {config.get('version')!r}; expected "
                       f"{FORMAT!r} version {VERSION}", hint="export the checkpoint again with this nam")
    fields = {f.name for f in dataclasses.fields(NAM56RConfig)}
    model = config.get("model", {})
    unknown = sorted(set(model) - fields)
    if unknown:
        raise NamError(f"{path}: model fields {unknown} are not NAM56RConfig's",
                       hint="load it with the nam version that exported it")
    # JSON has no tuples: the config's tuple fields come back from lists
    return NAM56RConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in model.items()}), config


def load_state(folder: Path) -> dict[str, torch.Tensor]:
    """The exported tensors (CPU), after their file's sha256 matched config.json's."""
    st = safetensors_torch()
    _, config = read_config(folder)
    weights = Path(folder) / WEIGHTS
    if not weights.is_file() or _sha256(weights) != config.get("sha256", {}).get(WEIGHTS):
        raise NamError(f"{weights} is missing or its sha256 differs from {CONFIG}'s (the file changed after the "
                       "export)", hint="export the checkpoint again")
    return st.load_file(str(weights))


def initial_optimizer(path: Path, *, numerics: str, dtype: str) -> ExportedOptimizer | None:
    """AdamW's state an export folder carries (``nam export --with-optimizer``), for a run of ``numerics`` and
    ``dtype``; None when it carries none (weights only) or ``path`` is a bare weights file. Refused: another
    optimizer_numerics or dtype than the run's (moments kept in other dtypes, or masters where the run has none,
    would not continue the same training), and a file whose sha256 differs from config.json's."""
    path = Path(path)
    if not path.is_dir():
        return None
    _, config = read_config(path)
    meta = config.get("optimizer")
    if meta is None:
        return None
    if (meta.get("numerics"), meta.get("dtype")) != (numerics, dtype):
        raise ConfigError(f"{path} carries optimizer state of train.optimizer_numerics={meta.get('numerics')} and "
                       f"train.dtype={meta.get('dtype')}; this run has {numerics} and {dtype}",
                       hint=f"--set train.optimizer_numerics={meta.get('numerics')} --set train.dtype="
                            f"{meta.get('dtype')}, or start from its weights alone: nam export CKPT --out DIR "
                            "(without --with-optimizer), then --init-from DIR")
    file = path / OPTIMIZER
    if not file.is_file() or _sha256(file) != config.get("sha256", {}).get(OPTIMIZER):
        raise NamError(f"{file} is missing or its sha256 differs from {CONFIG}'s (the file changed after the "
                       "export)", hint="export the checkpoint again")
    return ExportedOptimizer(step=int(meta["step"]), numerics=numerics, dtype=dtype, state=_OnDemand(file))


class _OnDemand(Mapping):
    """An export's optimizer state by parameter name, each parameter's tensors read from the file when asked for
    (safetensors reads one tensor at a time): a megatron rank takes its slices of one parameter after another
    instead of holding the whole state of the model, three times the weights in fp32."""

    def __init__(self, file: Path):
        safetensors_torch()
        from safetensors import safe_open

        self.file, self._open = file, safe_open
        self.kinds: dict[str, list[str]] = {}
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                kind, _, name = key.partition("/")
                self.kinds.setdefault(name, []).append(kind)

    def __getitem__(self, name: str) -> dict[str, torch.Tensor]:
        with self._open(str(self.file), framework="pt") as f:
            return {kind: f.get_tensor(f"{kind}/{name}") for kind in self.kinds[name]}

    def __iter__(self):
        return iter(self.kinds)

    def __len__(self) -> int:
        return len(self.kinds)


def initial_weights(path: Path, cfg: NAM56RConfig) -> dict[str, torch.Tensor]:
    """The weights a run starts from (``nam train --init-from``): an export folder, whose model config must be
    the run's (a difference is refused with the fields that differ), read after its sha256 matched; or a bare
    state dict file (``torch.save`` of tensors only: the benches' shared initial weights), read with
    ``weights_only=True``. Either engine maps nam56r's names onto its own model from here."""
    path = Path(path)
    check_init_from(path, cfg)
    if path.is_dir():
        return load_state(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def check_init_from(path: Path, cfg: NAM56RConfig) -> None:
    """What ``initial_weights`` refuses that its config tells without reading a tensor: a path that is neither an
    export folder nor a file, an export of another model (the fields that differ named). ``nam train`` asks it
    before anything is activated or written, dry runs included."""
    path = Path(path)
    if path.is_dir():
        exported, _ = read_config(path)
        ours, theirs = dataclasses.asdict(cfg), dataclasses.asdict(exported)
        differ = {k: (theirs[k], ours[k]) for k in ours if theirs.get(k) != ours[k]}
        if differ:
            shown = ", ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in sorted(differ.items())[:6])
            raise ConfigError(f"{path} holds another model than this run's ({len(differ)} fields differ: {shown})",
                              hint="train the recipe it was exported from (its config.json 'model'), or --set the "
                                   "fields to match")
    elif not path.is_file():
        raise ConfigError(f"--init-from {path}: no such export folder or weights file",
                          hint="nam export RUN_DIR --out DIR, then --init-from DIR")


def load(folder: Path, *, backends=None, device: str | torch.device = "cpu"):
    """The exported NAM56R, built from config.json with ``backends`` (default: the reference backends) and every
    tensor loaded bit for bit (``strict=True``), in eval mode."""
    from nam56r.model import build_model

    cfg, _ = read_config(folder)
    state = load_state(folder)
    model = build_model(cfg, backends, device=device)
    own = model.state_dict()
    for name, value in state.items():  # each parameter in its stored dtype (bf16 weights, fp32 D and dt_bias)
        if name in own and own[name].dtype != value.dtype:
            _set_dtype(model, name, value.dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise NamError(f"{folder}: the exported tensors do not fill NAM56R (missing {missing[:8]}, unexpected "
                       f"{unexpected[:8]})", hint="the export and this nam56r disagree on the model's shape")
    return model.eval()


def _set_dtype(model: torch.nn.Module, name: str, dtype: torch.dtype) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    value = getattr(module, attr)
    if isinstance(value, torch.nn.Parameter):
        value.data = value.data.to(dtype)
    elif isinstance(value, torch.Tensor):
        setattr(module, attr, value.to(dtype))
