"""Where the CLI writes: tables and results to stdout, diagnostics to stderr.

Output that is not a terminal (a pipe, a file, CI's log) is 80 columns wide unless ``COLUMNS`` says otherwise,
so a table may be narrower than its text. Tables made by ``table`` wrap and never cut: no cell ends in an
ellipsis, and commands (hints) go below the table as whole lines (``print_hints``), which are never wrapped,
so they can be copied as they are.
"""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.table import Table

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

STATUS_STYLE = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skip": "[yellow]skip[/yellow]"}


def table(*columns: str, title: str | None = None, names: tuple[str, ...] = (), right: tuple[str, ...] = (),
          **options) -> Table:
    """A rich Table whose cells wrap at spaces and fold a longer word onto the next line instead of cutting it.
    ``names``: columns of names (plugins, checks, recipes), kept on one line while any other column can give
    way; ``right``: right-justified columns (numbers)."""
    t = Table(title=title, **options)
    for col in columns:
        t.add_column(col, overflow="fold", no_wrap=col in names, justify="right" if col in right else "left")
    return t


def print_hints(rows: list[tuple[str, str]], *, title: str = "next steps") -> None:
    """``(who, hint)`` pairs as whole lines below a table, each distinct hint once: a command in a hint is
    never wrapped or cut, whatever the width."""
    seen = dict.fromkeys((who, hint) for who, hint in rows if hint)
    if not seen:
        return
    out.print(f"{title}:")
    for who, hint in seen:
        out.print(f"  {who}: {hint}", markup=False, highlight=False)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
