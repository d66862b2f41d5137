"""``nam``: the typer app, and the one place that turns a NamError into stderr text and an exit code."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Annotated, Optional

import typer

from nam_cli import data, export, patches, plot, plugins, preflight, recipe, train
from nam_cli.console import err
from nam_core import __version__
from nam_core.errors import Interrupted, NamError

class _Group(typer.core.TyperGroup):
    """The root group: once the command tree is assembled, its help reads as nam's docs write it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        tidy_help(self)


def tidy_help(command) -> None:
    """Help and usage lines without type tags: a flag shows no ``<bool>``, an option shows its declared
    metavar (``--set KEY=VALUE``) or its type, an argument reads ``SRC`` (``nam data prepare [OPTIONS] SRC``)
    instead of ``{src}``. Walks ``command`` and every subcommand; idempotent."""
    for param in command.params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
        elif param.param_type_name == "argument":
            param.metavar = param.metavar or param.name.upper()
            param.get_usage_pieces = lambda ctx, p=param: [p.metavar + ("..." if p.nargs != 1 else "")]
    if not getattr(command, "_nam_tidy", False):  # --help is made per call: tidy it as it is made
        command._nam_tidy, made = True, command.get_help_option
        command.get_help_option = lambda ctx: _no_metavar(made(ctx))
    for sub in getattr(command, "commands", {}).values():
        tidy_help(sub)


def _no_metavar(option):
    if option is not None:
        option.metavar = ""
    return option


app = typer.Typer(
    cls=_Group,
    name="nam",
    help="Train NAM56R: fail-closed plugins, preflight checks, a patch lane for upstream bugs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(plugins.app, name="plugins")
app.add_typer(patches.app, name="patches")
app.add_typer(recipe.app, name="recipe")
app.add_typer(data.app, name="data")
app.command("preflight")(preflight.preflight)
app.command("train")(train.train)
app.command("export")(export.export)
app.command("plot")(plot.plot)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nam {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = None,
) -> None:
    """Train NAM56R: fail-closed plugins, preflight checks, a patch lane for upstream bugs."""


def report(error: NamError) -> None:
    from rich.markup import escape  # a message or hint is text: pip install -e '.[export]' keeps its brackets

    label = "stopped" if isinstance(error, Interrupted) else "error"  # a stop asked for is not a failure
    err.print(f"[bold red]{label}:[/bold red] {escape(error.message)}", markup=True, highlight=False)
    if error.hint:
        err.print(f"[bold]hint:[/bold] {escape(error.hint)}", highlight=False)
    if error.exit_code == 1:  # a failure nobody expected (a bug); the others are expected and say what to do
        err.print("set NAM_DEBUG=1 for the full traceback", style="dim")


def _interrupt(signum: int, frame) -> None:
    """SIGINT/SIGTERM/SIGHUP outside a training loop (which installs its own stop-after-the-step handlers): end the
    command as a stop, exit 128 + signal, instead of click's "Aborted!" with exit 1 (SIGINT) or an
    unhandled kill (SIGTERM); the exception unwinds through every cleanup on the way out."""
    name = signal.Signals(signum).name
    raise Interrupted(f"interrupted by {name}", signum=signum, hint="run the same command again to start over")


def run(argv: list[str] | None = None) -> int:
    """Run the CLI with ``argv``; return the exit code instead of exiting (tests call this)."""
    command = typer.main.get_command(app)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(command, argv)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run(command, argv: list[str] | None) -> int:
    try:
        # Standalone mode: click prints usage errors itself and exits 2; a NamError passes through it.
        command.main(args=argv, prog_name="nam", standalone_mode=True)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except NamError as e:
        if os.environ.get("NAM_DEBUG") == "1":
            raise
        report(e)
        return e.exit_code
    except OSError as e:  # a path a person fixes (an --out, a --run-dir, a cache folder): one block, exit 6
        readable = _path_error(e)
        if readable is None or os.environ.get("NAM_DEBUG") == "1":
            raise
        report(readable)
        return readable.exit_code
    return 0


def _path_error(exc: OSError):
    """An OSError that names a path and says what a person can fix there (permission, no such folder, read-only,
    no space, a file where a folder should be) as a RunFolderError (exit 6); None for any other (a traceback)."""
    import errno

    from nam_core.engine.rundir import _WHY
    from nam_core.errors import RunFolderError

    why = {**_WHY, errno.ENOENT: "no such file or folder"}.get(exc.errno)
    if why is None or not exc.filename:
        return None
    return RunFolderError(f"cannot use {exc.filename}: {why}",
                          hint="check that the path's folder exists and this user may write there, or choose another "
                               "path (NAM_DEBUG=1 shows where it was met)")


def main() -> None:
    from nam_core.engine.summary import mark_launch

    mark_launch()  # the summary's time from launch to the first step starts here (or in the nam that launched us)
    sys.exit(run())
