"""``nam export``: a checkpoint of either engine -> safetensors + config JSON + tokenizer, loadable with nam56r
alone (``nam56r.export.load``; the folder's layout is described there).

Local-engine checkpoints (``checkpoints/step-N``, any format ``nam_core.engine.checkpoint`` loads) are read through
``checkpoint.model_state``; megatron-engine checkpoints (dist-checkpointing shards of any parallel layout) through
``nam_core.engine.megatron.checkpoint.model_tensors``, in this one process, and renamed to nam56r's names by
``nam56r.megatron.weights.megatron_state_to_nam``. Either way the export holds the model's weights bit for bit, in
the dtype they were trained in; ``nam train --init-from`` starts either engine from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import torch
import typer

from nam_cli.console import out, print_json
from nam_cli.options import JsonOpt


def _checkpoint_folder(path: Path) -> Path:
    """``path`` itself when it is a checkpoint folder; the newest good one when it is a run folder."""
    from nam_core.engine import checkpoint
    from nam_core.engine.megatron import checkpoint as megatron
    from nam_core.errors import ConfigError

    if not path.is_dir():
        raise ConfigError(f"{path}: no such folder", hint="nam export RUN_DIR (its newest good checkpoint) or "
                                                           "nam export RUN_DIR/checkpoints/step-N")
    if (path / "manifest.json").is_file():
        return path
    good = sorted(checkpoint.good_checkpoints(path / "checkpoints") + megatron.good_checkpoints(path / "checkpoints"))
    if good:
        return good[-1]
    where = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    raise ConfigError(f"{path} is neither a checkpoint folder (no manifest.json) nor a run folder with a good "
                      "checkpoint", hint=f"point at a checkpoint: ls {where}")


def _model_state(folder: Path) -> tuple[dict, dict, str]:
    """The checkpoint's model weights under nam56r's names, its manifest, and the engine that wrote it."""
    from nam_core.engine import checkpoint as local
    from nam_core.engine.megatron import checkpoint as megatron

    try:
        fmt = json.loads((folder / "manifest.json").read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        fmt = None
    if fmt == megatron.CHECKPOINT_FORMAT:
        from nam56r.megatron.weights import megatron_state_to_nam

        tensors, manifest = megatron.model_tensors(folder)
        return megatron_state_to_nam(tensors, _model_config(folder, manifest)), manifest, "megatron"
    state, manifest = local.model_state(folder)  # refuses what is not a good local checkpoint, with the reason
    return state, manifest, "local"


def _model_config(folder: Path, manifest: dict):
    """The NAM56RConfig the run record of a checkpoint's manifest holds."""
    from nam56r.config import NAM56RConfig
    from nam_core.errors import NamError

    record = manifest.get("record", {})
    if "model" not in record:
        raise NamError(f"{folder / 'manifest.json'} records no model config (a checkpoint from before run records)",
                       hint="export a checkpoint written by this nam")
    return NAM56RConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["model"].items()})


def _optimizer(folder: Path, manifest: dict, engine: str, state: dict, cfg):
    """AdamW's state of a checkpoint under nam56r's parameter names (``nam export --with-optimizer``)."""
    from nam56r.export import ExportedOptimizer
    from nam56r.model import build_model
    from nam_core.engine import checkpoint as local
    from nam_core.engine.numerics import state_by_name
    from nam_core.errors import RunFolderError

    train = manifest.get("record", {}).get("train", {})
    named = list(build_model(cfg, device="meta").named_parameters())
    numerics, dtype = train.get("optimizer_numerics", "fp32-master"), train.get("dtype", "float32")
    if engine != "local":
        return _megatron_optimizer(folder, named, state, cfg, numerics, dtype)
    try:
        by_name, step = state_by_name(local.optimizer_state(folder), named, {n: v.dtype for n, v in state.items()},
                                      numerics)
    except ValueError as e:
        raise RunFolderError(f"{folder}: {e}",
                             hint=f"export its weights alone: nam export {folder} --out DIR") from None
    return ExportedOptimizer(step=step, numerics=numerics, dtype=dtype, state=by_name)


def _megatron_optimizer(folder: Path, named: list, state: dict, cfg, numerics: str, dtype: str):
    """A megatron-engine checkpoint's AdamW state under nam56r's names: the distributed optimizer's shards put
    together per parameter (``optimizer_tensors``), renamed as the weights are; its fp32 main weights are the
    masters of the parameters the model keeps in bf16 (the others' are the weights themselves)."""
    from nam56r.export import ExportedOptimizer
    from nam56r.megatron.weights import megatron_state_to_nam
    from nam_core.engine.megatron import checkpoint as megatron
    from nam_core.errors import RunFolderError

    tensors, step = megatron.optimizer_tensors(folder)
    names = [n for n, p in named if p.requires_grad]
    kinds = {k: megatron_state_to_nam({key: v[k] for key, v in tensors.items()}, cfg, names=names)
             for k in ("param", "exp_avg", "exp_avg_sq")}
    out = {n: {"exp_avg": kinds["exp_avg"][n], "exp_avg_sq": kinds["exp_avg_sq"][n]} for n in names}
    for n in names:
        if state[n].dtype != torch.float32:
            out[n]["master"] = kinds["param"][n]
        # the map's check: an fp32 weight is its own main param, a bf16 one its master rounded to nearest
        if not torch.equal(kinds["param"][n].to(state[n].dtype), state[n]):
            raise RunFolderError(f"{folder}: the optimizer's main weights of {n} differ from the model's (the "
                                 "optimizer map places its shards wrongly)",
                                 hint=f"export its weights alone: nam export {folder} --out DIR; and report this")
    return ExportedOptimizer(step=int(step), numerics=numerics, dtype=dtype, state=out)


def _tokenizer(record: dict, spec: str | None, vocab_size: int) -> tuple[dict, Path | None]:
    """The tokenizer's description and its tokenizer.json (None for the byte tokenizer): ``--tokenizer`` when
    given, else what the run's dataset was prepared with, if that dataset is still the one the run recorded
    (its files' sha256: data prepared again under the same path may have another tokenizer). Either way its ids
    must fit the model's ``vocab_size``."""
    from nam_core.data.dataset import identity
    from nam_core.data.tokenizer import load_tokenizer, tokenizer_from_description
    from nam_core.errors import ConfigError

    if spec is not None:
        tok = load_tokenizer(spec)
    else:
        data = record.get("data")
        manifest = Path(data or "") / "dataset.json"
        if not data or not manifest.is_file():  # no corpus recorded: rows a test or bench made
            raise ConfigError(f"the run's dataset ({data}) is not there to read its tokenizer from",
                              hint="name it: --tokenizer byte, or --tokenizer PATH/TO/tokenizer.json")
        recorded = record.get("dataset")
        if recorded is not None and {k: v for k, v in identity(data).items() if k in recorded} != recorded:
            raise ConfigError(f"the run's dataset {data} changed since the run trained on it (its files' sha256 "
                              "differ from the run's record): its tokenizer may not be the one the model learned",
                              hint="name the run's tokenizer: --tokenizer byte, or --tokenizer PATH/TO/tokenizer.json")
        tok = tokenizer_from_description(json.loads(manifest.read_text())["tokenizer"])
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids; the model's vocabulary has {vocab_size}",
                          hint="export with the tokenizer the run was trained with (--tokenizer)")
    desc = tok.describe()
    return desc, Path(desc["path"]) if desc.get("kind") == "huggingface" else None


def export(
    checkpoint: Annotated[Path, typer.Argument(help="A checkpoint folder (runs/NAME/checkpoints/step-N), or a run "
                                               "folder (its newest good checkpoint).")],
    out_dir: Annotated[Path, typer.Option("--out", help="The export folder to write (created atomically).")],
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", help="'byte' or a tokenizer.json; default: "
                                                     "the one the run's dataset was prepared with.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out if it is not empty.")] = False,
    with_optimizer: Annotated[bool, typer.Option("--with-optimizer", help="Also AdamW's state (moments, fp32 "
                                                 "masters, step): --init-from then "
                                                 "continues the run at its step, on either engine.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Export a checkpoint of either engine (megatron: saved at any pp/ep) as safetensors + config.json +
    tokenizer (load: nam56r.export.load; start a run from it: nam train --init-from)."""
    from nam56r import export as exported
    from nam56r.export import read_config
    exported.safetensors_torch()  # fail before reading gigabytes
    folder = _checkpoint_folder(checkpoint)
    state, manifest, engine = _model_state(folder)
    record = manifest.get("record", {})
    cfg = _model_config(folder, manifest)
    desc, tok_file = _tokenizer(record, tokenizer, cfg.vocab_size)
    source = {"checkpoint": str(folder.resolve()), "recipe": record.get("recipe"), "engine": engine}
    if "layout" in manifest:
        source["layout"] = manifest["layout"]
    optimizer = _optimizer(folder, manifest, engine, state, cfg) if with_optimizer else None
    written = exported.write(out_dir, state, cfg, step=manifest["step"], tokenizer=desc, tokenizer_file=tok_file,
                             source=source, overwrite=overwrite, optimizer=optimizer)
    _, config = read_config(written)
    info = {"out": str(written), "step": config["step"], "engine": engine, "tensors": len(state),
            "dtypes": config["dtypes"], "tokenizer": desc.get("name"), "optimizer": config.get("optimizer"),
            "sha256": config["sha256"]}
    if json_out:
        print_json(info)
        return
    out.print(f"exported {folder} ({engine} engine, step {info['step']}) to {written}: {info['tensors']} tensors "
              f"({', '.join(info['dtypes'])}), tokenizer {info['tokenizer']}")
    if optimizer is not None:
        out.print(f"with the optimizer ({optimizer.describe()}): nam train --init-from {written} continues at step "
                  f"{optimizer.step + 1}")
    out.print(f"load it: python -c \"from nam56r.export import load; model = load('{written}')\"")
