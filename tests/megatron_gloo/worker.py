"""One run for tests/test_megatron_engine_gloo.py: the megatron engine on gloo (under torchrun, with the CUDA
test double) or the local engine, both on nam56r-tiny in fp32 with the reference backends, on fixed random
rows (micro-batch ``i`` is a pure function of ``i``).

    torchrun --nproc-per-node 2 worker.py megatron RUN_DIR STEPS --pp 1 --ep 2 [--resume CKPT]
    torchrun --nproc-per-node 2 worker.py megatron RUN_DIR STEPS --pp 2 --schedule dualpipev --grad-accum 4
    torchrun --nproc-per-node 1 worker.py megatron RUN_DIR STEPS --dtype bfloat16 --fused-adam-stand-in
    torchrun --nproc-per-node 1 worker.py megatron RUN_DIR STEPS --dtype bfloat16 --precision-aware-stand-in
    python worker.py local RUN_DIR STEPS --grad-accum 4 [--perturb 1e-6] [--eval] [--init-from EXPORT --first-batch 8]
    torchrun --nproc-per-node 2 worker.py cli RUN_DIR STEPS -- train --engine megatron --ep 2 --plugins ...

``cli`` runs ``nam train`` itself in each rank (the CLI's whole path: plugin activation on an H100 profile,
patches, the packed corpus, the run folder, plugin step hooks) on the double; the arguments after ``--``
are the command's, to which the worker adds ``--run-dir`` and ``--max-steps``.
"""

import argparse
import os
from pathlib import Path

import torch

MICRO_BATCH = 2
PER_RANK_ACCUM = 2


def batch_at(index: int, size: int, cfg) -> dict:
    g = torch.Generator().manual_seed(1000 + index)
    t = torch.randint(0, cfg.vocab_size, (size, cfg.seq_len + 1), generator=g)
    segments = torch.zeros(size, cfg.seq_len, dtype=torch.long)
    segments[:, cfg.seq_len // 3:] = 1  # two documents per row: MTP targets masked at the boundary
    return {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(size, cfg.seq_len),
            "segment_ids": segments, "structure": torch.randint(0, 16, (size, cfg.seq_len), generator=g)}


EVAL = ["train.eval_every=2", f"train.eval_tokens={4 * MICRO_BATCH * 64}"]
"""``--eval``: an evaluation after steps 2 and 4 over 4 held-out micro-batches of nam56r-tiny's 2 x 64: all 4 on one
rank in the local engine (grad-accum 4), 2 on each of 2 data-parallel ranks in the megatron engine."""

STEP3 = 2 * 4
"""The first micro-batch index of step 3 at 4 micro-batches a step (local grad-accum 4; megatron dp 2 x 2)."""


def held_out(cfg):
    """Step 3's own training rows, held out: evaluated after step 2, on the weights step 3 trains from, the
    validation loss must be step 3's LM loss (tests/test_megatron_engine_gloo.py)."""
    from nam_core.engine.validation import HeldOut

    return HeldOut(batch_at=lambda i, b: batch_at(STEP3 + i, b, cfg), rows=4 * MICRO_BATCH, seq_len=cfg.seq_len,
                   source="step 3's rows")


def _install_double(fused_adam: bool = False):
    """The CUDA double, and the engine's NCCL/CUDA entry points pointed at gloo and the CPU (``fused_adam``: the
    process facts report Transformer Engine's FusedAdam, for the stand-in)."""
    import cuda_double  # this folder is on sys.path: the script runs from it

    cuda_double.install()
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from nam_core.engine import megatron as engine
    from nam_core.engine.megatron import checks, parallel

    def init_parallel(*, tp, pp, ep, seed, schedule=None):  # gloo, not NCCL; no CUDA RNG tracker (no dropout)
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            get_embedding_ranks=schedule.embedding_ranks() if schedule is not None else None)
        return ProcessGroupCollection.use_mpu_process_groups()

    def facts():
        return {"megatron": engine.megatron_version(), "python": (3, 12), "cuda": True, "distributed": True,
                "world_size": int(os.environ["WORLD_SIZE"]), "psutil": True, "deep_ep": False,
                **({"fused_adam": "transformer_engine"} if fused_adam else {})}

    # The loop calls the parts' functions; nam train (cli/train.py) the package's.
    engine.init_parallel = parallel.init_parallel = init_parallel
    engine.device = parallel.device = lambda: torch.device("cpu")
    engine.runtime_facts = checks.runtime_facts = facts
    engine.init_distributed = parallel.init_distributed = (
        lambda: torch.distributed.is_initialized() or torch.distributed.init_process_group("gloo"))
    return engine


def megatron_run(args, recipe) -> None:
    """The run through the composition root, as ``nam train`` builds it: resolve, start the engine, build
    (activation on an H100 profile: the plugins' checks, nothing touches CUDA; the backends from the
    registries; the lowering made from the registered schedule), the host's lifecycle hooks; the worker's own
    rows in place of the corpus."""
    _install_double(fused_adam=args.precision_aware_stand_in)
    if args.non_finite_at is not None:  # the step's loss as the guard sees it: NaN at that step (0-based)
        from nam_core.engine.megatron import loop

        real, calls = loop._step_means, []

        def poisoned(run, s, losses):
            means, notes = real(run, s, losses)
            calls.append(None)
            return ({**means, "loss": float("nan")} if len(calls) - 1 == args.non_finite_at else means), notes

        loop._step_means = poisoned
    if args.stop_after_start:  # SIGTERM as the model's build and the checkpoint's load end (a preemption then)
        import signal

        from nam_core.engine.megatron import loop

        started = loop._start

        def start_then_stop(*a, **kw):
            session = started(*a, **kw)
            os.kill(os.getpid(), signal.SIGTERM)
            return session

        loop._start = start_then_stop
    if args.fused_adam_stand_in or args.precision_aware_stand_in:
        import fused_adam  # this folder is on sys.path: the script runs from it

        fused_adam.install(precision_aware=args.precision_aware_stand_in)
        if args.precision_aware_stand_in:
            _ledger_of_the_load(fused_adam.LEDGER, args.run_dir)
    if args.load_targets_fit:  # the GPU (this CPU, under the double) has room for the rebuild beside the targets
        from nam_core.engine.megatron import checkpoint

        checkpoint._free_for_load = lambda: 1 << 50
    from nam56r.run import RunRequest, build, resolve
    from nam_core.device import DeviceInfo
    from nam_core.engine.contract import engine_for
    from nam_core.host import PluginHost

    schedule = args.schedule or ("1f1b" if args.pp > 1 else "single")
    overrides = ["attention_backend=reference",  # by name: the reference core on "cuda" (the double's CPU)
                 f"train.dtype={args.dtype}", f"train.micro_batch_size={MICRO_BATCH}",
                 f"train.grad_accum={args.grad_accum}", "train.checkpoint_every=2", "train.keep_checkpoints=10",
                 "train.total_steps=20", f"train.schedule={schedule}", *(EVAL if args.eval else []), *args.set]
    host = PluginHost()
    run = resolve(RunRequest(recipe=recipe.name, plugins=["dualpipev"] if schedule == "dualpipev" else [],
                             overrides=overrides, engine="megatron", device="cuda", pp=args.pp, ep=args.ep,
                             max_steps=args.steps, env_plugins=False), host)
    engine = engine_for("megatron")
    session = build(run, host, engine, engine.start(run.spec, dry_run=False), device=DeviceInfo.profile("h100"),
                    quiet=True, batches=lambda i, b: batch_at(i, b, run.spec.model), init_from=args.init_from)
    session.held_out = held_out(run.spec.model) if args.eval else None
    engine.train(session.engine_run(args.run_dir, resume_from=args.resume, quiet=True))
    engine.finish()  # after success only: on an error the other ranks may sit in a collective


def _ledger_of_the_load(ledger, run_dir: Path) -> None:
    """The resume's optimizer tensors as the stand-in counts them (fused_adam.LEDGER), into RUN_DIR/load-ledger.json:
    ``peak``, the most bytes alive at once during ``load_checkpoint``, and ``state``, what they are after it."""
    import json

    from nam_core.engine.megatron import checkpoint

    load = checkpoint.load_checkpoint

    def load_checkpoint(*args, **kwargs):
        ledger.reset()
        manifest = load(*args, **kwargs)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "load-ledger.json").write_text(json.dumps({"peak": ledger.peak, "state": ledger.live}))
        return manifest

    checkpoint.load_checkpoint = load_checkpoint


def grads_run(args, recipe) -> None:
    """bench/megatron.py's step-1 gradient comparison, on gloo with the CUDA double."""
    import importlib.util

    _install_double()
    from nam56r.run import RunRequest, build, resolve
    from nam_core.device import DeviceInfo
    from nam_core.engine.contract import engine_for
    from nam_core.host import PluginHost

    spec = importlib.util.spec_from_file_location("bench_megatron", Path(__file__).parents[2] / "bench" / "megatron.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    overrides = ["attention_backend=reference", "train.dtype=float32", f"train.micro_batch_size={MICRO_BATCH}",
                 f"train.grad_accum={PER_RANK_ACCUM}"]
    host = PluginHost()
    run = resolve(RunRequest(recipe=recipe.name, overrides=overrides, engine="megatron", device="cuda", ep=args.ep,
                             env_plugins=False), host)
    engine = engine_for("megatron")
    session = build(run, host, engine, engine.start(run.spec, dry_run=False), device=DeviceInfo.profile("h100"),
                    quiet=True, batches=lambda i, b: batch_at(i, b, run.spec.model))
    args.run_dir.mkdir(parents=True, exist_ok=True)
    bench.step1_gradients(session, args.run_dir)


def local_run(args, recipe) -> None:
    """The local engine through the composition root on the worker's rows (``--perturb``: the floor run)."""
    from nam56r.run import RunRequest, build, resolve
    from nam_core.engine.contract import engine_for
    from nam_core.host import PluginHost

    overrides = ["train.dtype=float32", f"train.micro_batch_size={MICRO_BATCH}", f"train.grad_accum={args.grad_accum}",
                 "train.checkpoint_every=100", "train.total_steps=20", *(EVAL if args.eval else []), *args.set]
    host = PluginHost()
    run = resolve(RunRequest(recipe=recipe.name, overrides=overrides, device="cpu", max_steps=args.steps,
                             env_plugins=False), host)
    engine = engine_for("local")
    session = build(run, host, engine, quiet=True, init_from=args.init_from,
                    batches=lambda i, b: batch_at(args.first_batch + i, b, run.spec.model))
    if args.perturb:  # the floor: the same run from weights moved at rounding level
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in session.trainable().module.parameters():
                p.mul_(1 + args.perturb * (2 * torch.rand(p.shape, generator=g) - 1))
    args.run_dir.mkdir(parents=True, exist_ok=True)
    session.held_out = held_out(run.spec.model) if args.eval else None
    engine.train(session.engine_run(args.run_dir, quiet=True))


def cli_run(args, recipe) -> None:
    _install_double()
    from nam56r import run as root
    from nam_cli import main as cli_main
    from nam_core.device import DeviceInfo

    root.run_device = lambda spec, *, profile=None, index=0: DeviceInfo.profile("h100")  # what the plugins' checks see
    code = cli_main.run([*args.command, "--run-dir", str(args.run_dir), "--max-steps", str(args.steps)])
    if code:
        raise SystemExit(code)


def main() -> None:
    from nam56r.recipes import get_recipe

    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["megatron", "local", "grads", "cli"])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("steps", type=int)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--resume", type=Path, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="megatron runs only")
    ap.add_argument("--schedule", default=None, help="train.schedule (default: single at pp 1, else 1f1b)")
    ap.add_argument("--grad-accum", type=int, default=PER_RANK_ACCUM)
    ap.add_argument("--perturb", type=float, default=0.0)
    ap.add_argument("--init-from", type=Path, default=None, help="megatron and local runs: the export to start from")
    ap.add_argument("--first-batch", type=int, default=0,
                    help="local runs: the index of step 1's first micro-batch (another run's later step)")
    ap.add_argument("--eval", action="store_true", help="megatron and local runs: evaluate (EVAL)")
    ap.add_argument("--set", action="append", default=[], help="megatron and local runs: one more override, KEY=VALUE")
    ap.add_argument("--fused-adam-stand-in", action="store_true",
                    help="megatron runs: Megatron builds fused_adam.py's stand-in for Transformer Engine's FusedAdam")
    ap.add_argument("--precision-aware-stand-in", action="store_true",
                    help="megatron runs: the stand-in with master weights (Megatron's precision-aware optimizer; "
                         "the bf16-moments or fused-master numerics), the resume's optimizer memory counted")
    ap.add_argument("--load-targets-fit", action="store_true",
                    help="megatron runs: a resume finds room on the device for the optimizer's load targets "
                         "(checkpoint.targets_stay keeps them there; without this flag the CPU run has no GPU "
                         "and they go to host memory)")
    ap.add_argument("--non-finite-at", type=int, default=None,
                    help="megatron runs from step 0: the loss of this step (0-based) is NaN where the guard reads it")
    ap.add_argument("--stop-after-start", action="store_true",
                    help="megatron runs: SIGTERM to this process right after the engine's start (build, load)")
    ap.add_argument("command", nargs="*", help="cli: the nam command after --")
    args = ap.parse_args()
    run = {"megatron": megatron_run, "local": local_run, "grads": grads_run, "cli": cli_run}[args.engine]
    run(args, get_recipe("nam56r-tiny"))


if __name__ == "__main__":
    main()
