"""``nam train``: resolve, check everything, then train. Nothing is written until every check has passed.

Order: recipe + overrides (``nam56r.run.resolve``) -> the engine starts -> ``nam56r.run.build`` (device,
plugin activation: exit 3 on failure; patch lane; backends; model; dataset: exit 4 on failure) -> the run
folder (``RunFolder``: lock, how the run starts, its files) -> the engine trains -> the summary. With
``--resume``, the sha256 of the run folder's checkpoints starts on a background thread as the engine starts, so
it overlaps ``build``'s self-tests; the run folder's check then finds the digests made (``_verify_ahead``) and
decides as it would alone. ``--dry-run`` stops after building the model on the meta device and prints the
plan. This module holds the command's options and its hints; what a run is and how it trains live in
``nam56r.run`` and ``nam_core.engine``.

``--engine megatron`` runs one process per GPU under torchrun (``--nproc N`` starts torchrun itself; ``--nproc 1``
trains in this process, as torchrun's only worker): the allocator is set before CUDA starts, the runtime
(megatron-core >= 0.19, CUDA, torchrun, psutil) and the layout (``--tp/--pp/--ep``, the lowering's gaps) are
checked on every rank before anything is written, and rank 0 alone prepares the data and writes the run folder's
files.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from nam_cli import plan
from nam_cli.console import out, print_json, progress
from nam_cli.options import (
    DeviceOpt, DeviceProfileOpt, EpOpt, JsonOpt, NprocOpt, PluginsOpt, PpOpt, SetOpt, TpOpt,
)
from nam_core.engine import rundir
from nam_core.errors import ConfigError

RecipeOpt = Annotated[str, typer.Option("--recipe", "-r", help="Recipe name (`nam recipe list`).")]
MaxStepsOpt = Annotated[Optional[int], typer.Option("--max-steps", help="The step to stop at, counted from the "
                        "run's start (a resume trains up to it); the LR schedule length is train.total_steps.")]
RunDirOpt = Annotated[Optional[Path], typer.Option("--run-dir", help="Run folder (default runs/<recipe>).")]
DataOpt = Annotated[Optional[Path], typer.Option("--data", help="Prepared dataset folder (`nam data prepare`); "
                    "default: the Python standard library corpus, prepared once into the cache.")]
ResumeOpt = Annotated[Optional[str], typer.Option("--resume", help="'auto' (newest good checkpoint of "
                      "--run-dir; none yet: start afresh) or a checkpoint folder of this config. A resume may "
                      f"change {', '.join(rundir.RESUMABLE)} (recorded in history.jsonl).")]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Overrides train.seed.")]
EngineOpt = Annotated[str, typer.Option("--engine", help="local (one process) or megatron (Megatron-Core, one "
                      "process per GPU under torchrun or --nproc).")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Resolve, activate, build on the meta device, "
                      "print the plan; train nothing, write nothing.")]
InitFromOpt = Annotated[Optional[Path], typer.Option("--init-from", help="Start from these weights instead of "
                        "nam's initialisation: an export folder (`nam export`) of the same model, from either "
                        "engine's run. Weights only: the optimizer, the lr schedule and the data start afresh; "
                        "an export made with --with-optimizer continues that run at its step on either engine "
                        "(to continue a run in place, use --resume).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]
EvalDataOpt = Annotated[Optional[Path], typer.Option("--eval-data", help="Prepared dataset folder to evaluate on "
                        "(train.eval_every); default: the training data's validation split (nam data prepare "
                        "--val-fraction).")]


def _again(run_dir: Path, ctx: typer.Context | None) -> Callable[..., str]:
    """``again(resume="auto", sets={"train.lr": "3e-05"}, max_steps=20)``: this very command (``ctx``) again,
    with ``--run-dir`` and ``--resume`` set, those ``--set`` overrides replaced and ``--max-steps`` replaced
    (None: dropped; left out: as given); the hints of a refused start, a stop, the NaN guard and the summary
    print it, so it must be a command that works as written."""
    params = ctx.params if ctx is not None else {}
    base: list[str] = []
    at = 0  # where --max-steps goes: the place of its parameter
    for param in ctx.command.params if ctx is not None else []:
        value = params.get(param.name)
        at = len(base) if param.name == "max_steps" else at
        if param.name in ("run_dir", "resume", "set_", "dry_run", "json_out", "max_steps") \
                or value in (None, False) or value == param.default:
            continue
        flag = max((o for o in param.opts if o.startswith("--")), key=len)
        base += [flag] if value is True else [flag, str(value)]
    if params.get("nproc") is None and os.environ.get(RELAUNCHED_NPROC):  # torchrun's ranks of a --nproc N start
        base += ["--nproc", os.environ[RELAUNCHED_NPROC]]
    given = list(params.get("set_") or [])
    given_steps = params.get("max_steps")

    def again(*, resume: str | None = "auto", sets: dict | None = None, max_steps: int | None | str = "given") -> str:
        sets = sets or {}
        kept = [s for s in given if s.split("=", 1)[0].strip() not in sets]
        overrides = [*kept, *(f"{k}={v}" for k, v in sets.items())]
        steps = given_steps if max_steps == "given" else max_steps
        flags = [*base[:at], *(["--max-steps", str(steps)] if steps is not None else []), *base[at:]]
        return shlex.join(["nam", "train", *flags, "--run-dir", str(run_dir),
                           *(a for o in overrides for a in ("--set", o)), *(["--resume", resume] if resume else [])])

    return again


def train(
    ctx: typer.Context, recipe: RecipeOpt = "nam56r-tiny", plugins: PluginsOpt = None, max_steps: MaxStepsOpt = None,
    run_dir: RunDirOpt = None, data: DataOpt = None, resume: ResumeOpt = None, seed: SeedOpt = None,
    set_: SetOpt = None, device: DeviceOpt = None, engine: EngineOpt = "local", nproc: NprocOpt = None,
    tp: TpOpt = None, pp: PpOpt = None, ep: EpOpt = None, dry_run: DryRunOpt = False, quiet: QuietOpt = False,
    json_out: JsonOpt = False, device_profile: DeviceProfileOpt = None, eval_data: EvalDataOpt = None,
    init_from: InitFromOpt = None,
) -> None:
    """Train a recipe (default: nam56r-tiny on the CPU, on the Python standard library's source)."""
    from nam56r.run import RunRequest, build, resolve
    from nam_core.engine.contract import engine_for
    from nam_core.engine.summary import mark as mark_phase
    from nam_core.host import PluginHost

    plan.check_profile_flag(device_profile, dry_run)
    if init_from is not None and resume is not None:
        raise ConfigError("--init-from and --resume both say where the weights come from",
                       hint="--resume continues a run (weights, optimizer, data position); --init-from starts a new "
                            "one from exported weights: pass one")
    host = PluginHost()
    run = resolve(RunRequest(recipe=recipe, plugins=plugins, overrides=list(set_ or []), engine=engine,
                             device=device, seed=seed, tp=tp, pp=pp, ep=ep, nproc=nproc, max_steps=max_steps), host)
    mark_phase("resolve")
    if device_profile is not None:  # a GPU run planned on a machine without that GPU: no engine, no CUDA
        return plan.show(plan.on_profile(run, host, device_profile, run_dir=run_dir, data=data), json_out=json_out)
    eng = engine_for(run.spec.engine)
    ranks = eng.start(run.spec, dry_run=dry_run, relaunch=_relaunch)
    folder = rundir.RunFolder(run_dir or Path("runs") / run.spec.recipe)
    if dry_run:  # what a start refuses before writing, that a plan checks too: the folder's kind, the data's
        from nam_core.data.dataset import check_prepared

        rundir.check_usable(folder.path)
        if data is not None:
            check_prepared(data)
    with contextlib.ExitStack() as held:  # what the run holds (the folder's lock, the early check) goes on any exit
        ahead = None
        if resume is not None and not dry_run:  # the checkpoints' sha256 overlaps the self-tests (_verify_ahead)
            ahead = _verify_ahead(eng, folder)
            held.callback(ahead.stop)
        say = progress(ranks.writes and not (quiet or json_out or dry_run))
        session = build(run, host, eng, ranks, data=data, dry_run=dry_run, quiet=quiet or json_out, say=say,
                        eval_data=eval_data, init_from=init_from)
        if dry_run:
            return plan.show(plan.of_session(session, run_dir=run_dir, data=data), json_out=json_out)
        summary = _train(session, folder, resume, held=held, quiet=quiet or json_out, again=_again(folder.path, ctx),
                         say=say, ahead=ahead)
    if summary is not None:
        if json_out:
            print_json(summary)
        elif not quiet:
            from nam_core.engine.summary import describe, where_lines

            out.print(describe(summary), markup=False, highlight=False)
            for line in where_lines(summary):
                out.print(line, markup=False, highlight=False)
    eng.finish()


def _verify_ahead(eng, folder):
    """Start this rank's part of the engine's check of the run folder's checkpoints (``check_ahead``: the sha256
    of every file; under the megatron engine rank 0's, which the other ranks then take from it) on a background
    thread, before ``build``: the claim (``_train``) checks with ``good_checkpoints`` and finds the digests hashed,
    or waits for the files still being hashed. Its answer is not used, so it decides nothing
    (``checkpoint.VerifyAhead``); stopped after the claim (``_ahead_note``) and on every exit."""
    from nam_core.engine.checkpoint import VerifyAhead

    return VerifyAhead(eng.check_ahead, folder.checkpoints)


def _train(session, folder, resume: str | None, *, held, quiet: bool, again, say, ahead=None) -> dict | None:
    """The run folder (rank 0 locks and writes it; every rank reads how the run starts), the engine's training,
    and rank 0's summary (None on the other ranks). ``ahead``: the check of the checkpoints begun before ``build``
    (``_verify_ahead``), for the run log's note of what it spared the claim."""
    from nam_core.engine.summary import numerics_fields, summarize

    eng, writes, record, steps = session.engine, session.ranks.writes, session.record(), session.run.max_steps
    rundir.check_usable(folder.path)
    if writes:  # the filesystem's errors readable from the folder's creation on (a --run-dir where none can be)
        held.enter_context(rundir.readable_filesystem_errors(folder.path))
        held.enter_context(folder)
    began = time.monotonic()
    start = folder.claim(record, resume, good=eng.good_checkpoints, resolve=eng.resolve_resume, again=again,
                         max_steps=steps)  # a resume with no step left: exit 2, nothing written
    if ahead is not None:
        start.notes.append(_ahead_note(ahead, folder, claim_s=time.monotonic() - began))
    record["branch"] = start.branch  # every checkpoint says which line it belongs to (rundir: lineage)
    eng.barrier()  # every rank has looked at the run folder before rank 0 writes into it
    if writes:
        folder.begin(start, record, session.plugins_info())
    say(f"run folder: {folder.path} ({_start_text(start, steps)})")
    started = time.monotonic()  # the summary's wall time: training, checkpoints included
    result = eng.train(session.engine_run(folder.path, resume_from=start.resume_from, notes=start.notes,
                                          quiet=quiet, again=again, record=record))
    if not writes:
        return None
    result.update(run_dir=str(folder.path), recipe=session.spec.recipe, engine=session.spec.engine,
                  plugins=list(session.spec.plugins), **numerics_fields(session.spec.train), **summarize(
                      folder.metrics(), wall_s=time.monotonic() - started,
                      steps_run=result["steps"] - result["started_at_step"], tokens_per_step=result["tokens_per_step"],
                      first_step=result["started_at_step"] + 1, first_step_done_at=result.get("first_step_done_at")))
    last = result.get("last_checkpoint")
    result.update(rundir.whereabouts(folder.path, Path(last) if last not in (None, "None") else None,
                                     steps_run=result["steps_run"], again=again,
                                     total_steps=session.spec.train.total_steps))
    folder.write_summary(result)
    return result


def _ahead_note(ahead, folder, *, claim_s: float) -> str:
    """Stop the check begun before ``build`` (nothing is left for it: the claim needed every digest it makes) and
    say what it did: the run log's line, where the overlap shows on a GPU host."""
    ahead.stop()
    took = f"{ahead.seconds:.1f} s" if ahead.seconds is not None else f"still running after {ahead.STOP_WAIT_S:.0f} s"
    met = f"; it met {ahead.error!r}, which the run folder's check did not" if ahead.error is not None else ""
    return (f"checkpoint check: the sha256 of {folder.checkpoints} ran on a background thread during start-up "
            f"({took}{met}); the run folder's check took {claim_s:.1f} s after it")


def _start_text(start, steps: int) -> str:
    """How the run starts in its folder, and the steps it will train."""
    how = {"fresh": "a new run", "restart": "a new run; the stopped one moved aside",
           "resume": f"resuming from {start.resume_from}"}[start.kind]
    return f"{how}; steps {start.step + 1} to {steps}"


def _torchrun_argv(argv: list[str], nproc: int) -> list[str]:
    """This command again under torchrun with ``nproc`` processes, without ``--nproc``."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "nam_cli", *rest]


RELAUNCHED_NPROC = "NAM_RELAUNCHED_NPROC"
"""Set by ``_relaunch`` for torchrun's ranks: the ``--nproc`` the command was given, which the relaunched command
no longer carries, so the commands printed to continue a run (``_again``) carry it again."""


def _relaunch(nproc: int) -> None:
    """Replace this process with torchrun running this same command on ``nproc`` processes."""
    os.environ[RELAUNCHED_NPROC] = str(nproc)
    argv = _torchrun_argv(sys.argv[1:], nproc)
    os.execv(argv[0], argv)  # noqa: the same command, once per GPU
