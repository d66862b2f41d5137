"""``nam train``: resolve, check everything, then train. Nothing is written until every check has passed.

Order: recipe + overrides -> engine/device -> plugin activation (exit 3 on failure) -> patch lane ->
dataset (exit 4 on failure) -> run folder identity -> build -> train. ``--dry-run`` stops after building the
model on the meta device and prints the plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from pathlib import Path
from typing import Annotated, Optional

import typer

from nam_cli.console import out, print_json
from nam_cli.options import JsonOpt, PluginsOpt
from nam_core.errors import ConfigError, NamError

RecipeOpt = Annotated[str, typer.Option("--recipe", "-r", help="Recipe name (`nam recipe list`).")]
MaxStepsOpt = Annotated[Optional[int], typer.Option("--max-steps", help="Stop after this many steps (the LR "
                        "schedule length is train.total_steps).")]
RunDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", help="Run folder (default runs/<recipe>).")]
DataOpt = Annotated[Optional[Path], typer.Option("--data", help="Prepared dataset folder (`nam data prepare`); "
                    "default: the Python standard library corpus, prepared once into the cache.")]
ResumeOpt = Annotated[Optional[str], typer.Option("--resume", help="'auto' (newest good checkpoint of "
                      "--run-dir) or a checkpoint folder.")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Overrides train.seed.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="KEY=VALUE override: a model field, "
                   "train.<field>, or <plugin>.<option>. Repeatable.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu or cuda (default: the recipe's).")]
EngineOpt = Annotated[str, typer.Option("--engine", help="local (one process).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Resolve, activate, build on the meta device, "
                      "print the plan; train nothing, write nothing.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]


def cache_dir() -> Path:
    return Path(os.environ.get("NAM_CACHE_DIR", Path.home() / ".cache" / "nam"))


def _device(name: str):
    import torch

    from nam_core.device import DeviceInfo

    if name == "cpu":
        return DeviceInfo(kind="cpu", name="cpu", torch_version=torch.__version__)
    if name == "cuda":
        info = DeviceInfo.probe()
        if not info.is_cuda:
            raise NamError("--device cuda: no CUDA device is visible to this process",
                           hint="run on a GPU host, or train on the CPU with --device cpu", exit_code=3)
        return info
    raise ConfigError(f"--device {name!r}: expected cpu or cuda", hint="--device cpu")


def _dataset(data: Path | None, seq_len: int, vocab: int, seed: int, quiet: bool):
    from nam_core.data.dataset import PackedSequences, open_dataset

    if data is None:
        from nam56r.blocks.structure import char_structure_ids
        from nam_core.data.prepare import build_stdlib_corpus
        from nam_core.data.tokenizer import ByteTokenizer

        data = build_stdlib_corpus(cache_dir(), ByteTokenizer(), char_structure_ids, progress=not quiet)
    dataset = open_dataset(data)
    dataset.check_vocab(vocab)
    return data, PackedSequences(dataset, seq_len, seed)


def _record(recipe, plugins: list[str], host, data: Path) -> dict:
    """What makes two runs the same run: resuming under a different record is refused."""
    train = dataclasses.asdict(recipe.train)
    return {"recipe": recipe.name, "model": dataclasses.asdict(recipe.model), "train": train,
            "plugins": {n: host.installed[n].version for n in plugins}, "data": str(Path(data).resolve())}


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    changed = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            changed += _diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            changed.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return changed


def _check_run_dir(run_dir: Path, record: dict, resume: str | None) -> None:
    config_path = run_dir / "config.json"
    if run_dir.exists() and any(run_dir.iterdir()) and resume is None:
        raise ConfigError(f"run folder {run_dir} already holds a run",
                          hint=f"continue it with --resume auto, or choose another --run-dir")
    if resume is not None and config_path.exists():
        previous = json.loads(config_path.read_text())
        changed = _diff(previous, json.loads(json.dumps(record)))
        if changed:
            raise ConfigError(f"--resume: run folder {run_dir} belongs to a different config: "
                              + "; ".join(changed[:5]) + (" ..." if len(changed) > 5 else ""),
                              hint="resume with the same recipe and overrides, or start a new --run-dir")


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def train(
    recipe: RecipeOpt = "nam56r-tiny", plugins: PluginsOpt = None, max_steps: MaxStepsOpt = None,
    run_dir: RunDirOpt = None, data: DataOpt = None, resume: ResumeOpt = None, seed: SeedOpt = None,
    set_: SetOpt = None, device: DeviceOpt = None, engine: EngineOpt = "local", dry_run: DryRunOpt = False,
    quiet: QuietOpt = False, json_out: JsonOpt = False,
) -> None:
    """Train a recipe (default: nam56r-tiny on the CPU, on the Python standard library's source)."""
    import torch

    from nam56r.flops import flops_per_token
    from nam56r.model import Backends, build_model
    from nam56r.recipes import apply_overrides, get_recipe
    from nam56r.state import ForwardState
    from nam_core.engine import checkpoint
    from nam_core.engine.local import LocalRun, train as local_train
    from nam_core.host import PluginHost, requested_plugins
    from nam_core.patches import apply_all

    if engine != "local":
        raise ConfigError(f"--engine {engine!r} is not available in this version; the local engine is",
                          hint="use --engine local (the megatron engine arrives with its own release)")
    base = get_recipe(recipe)
    names = requested_plugins(base.plugins, plugins)
    host = PluginHost()
    infos = {n: info for n in names if n in host.installed and (info := host.info(n)) is not None}
    rec = apply_overrides(base, list(set_ or []), plugin_names=names, plugin_infos=infos)
    if seed is not None:
        rec = dataclasses.replace(rec, train=rec.train.replace(seed=seed))
    if device is not None:
        rec = dataclasses.replace(rec, train=rec.train.replace(device=device))
    steps = max_steps if max_steps is not None else rec.train.total_steps
    if steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, found {steps}", hint="--max-steps 80")
    dev = _device(rec.train.device)

    host.activate(names, dev, rec)  # PluginActivationError (exit 3) lists every failed check
    patch_reports = apply_all(host.registry("patches"))
    backends = Backends.from_registries(host.registries, rec.model, options=rec.train.plugin_options,
                                        device=rec.train.device)
    flops = flops_per_token(rec.model).total

    if dry_run:
        model = build_model(rec.model, backends, device="meta")
        plan = {"recipe": rec.name, "plugins": names, "selected_by_plugins": rec.notes, "device": dev.label, "max_steps": steps,
                "parameters": sum(p.numel() for p in model.parameters()), "flops_per_token": flops,
                "layers": "".join(l.spec.symbol for l in model.layers),
                "backends": {f.name: type(getattr(backends, f.name)).__name__ for f in dataclasses.fields(backends)},
                "patches": [r.to_dict() for r in patch_reports]}
        print_json(plan) if json_out else out.print(plan)
        return

    data_path, packed = _dataset(data, rec.model.seq_len, rec.model.vocab_size, rec.train.seed, quiet)
    run_dir = run_dir or Path("runs") / rec.name
    record = _record(rec, names, host, data_path)
    _check_run_dir(run_dir, record, resume)
    resume_from = checkpoint.resolve_resume(resume, run_dir / "checkpoints") if resume else None

    torch.manual_seed(rec.train.seed)
    dtype = getattr(torch, rec.train.dtype)
    model = build_model(rec.model, backends, device=rec.train.device).to(dtype=dtype)
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(run_dir / "config.json", record)
    _write_json_atomic(run_dir / "plugins.json", {
        "active": {n: {"distribution": host.installed[n].distribution, "version": host.installed[n].version}
                   for n in names},
        "backends": {f.name: type(getattr(backends, f.name)).__name__ for f in dataclasses.fields(backends)},
        "patches": [r.to_dict() for r in patch_reports],
        "python": platform.python_version(), "torch": torch.__version__, "device": dev.to_dict(),
    })

    keys = ("tokens", "labels", "loss_mask", "segment_ids", "structure")
    target = torch.device(rec.train.device)

    def batch_at(step: int, batch_size: int) -> dict:
        batch = packed.batch_at(step, batch_size)
        return {k: v.to(target) for k, v in batch.items() if k in keys}

    notes = list(rec.notes)

    def forward(batch: dict, micro_batch: int) -> dict:
        state = ForwardState(micro_batch=micro_batch, seq_layout=tuple(batch["tokens"].shape))
        out = model(**batch, state=state)
        notes.extend(state.log)  # the engine logs each distinct line once
        return out

    run = LocalRun(run_dir=run_dir, train=rec.train, model=model, forward=forward, batch_at=batch_at,
                   host=host, max_steps=steps, flops_per_token=flops, record=record,
                   resume_from=resume_from, quiet=quiet or json_out, notes=notes)
    summary = local_train(run)
    from nam_core.engine.metrics import read_metrics

    metrics = read_metrics(run_dir)
    summary.update(run_dir=str(run_dir), recipe=rec.name, plugins=names,
                   first_loss=metrics[0]["loss"] if metrics else None,
                   last_loss=metrics[-1]["loss"] if metrics else None)
    _write_json_atomic(run_dir / "summary.json", summary)
    if json_out:
        print_json(summary)
    elif not quiet:
        out.print(f"done: {steps} steps, loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}; "
                  f"run folder {run_dir}")
