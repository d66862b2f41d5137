"""Where the CLI writes: tables and results to stdout, diagnostics to stderr.

Output that is not a terminal (a pipe, a file, CI's log) is 80 columns wide unless ``COLUMNS`` says otherwise,
so a table may be narrower than its text. Tables made by ``table`` wrap and never cut: no cell ends in an
ellipsis, and commands (hints) go below the table as whole lines (``print_hints``), which are never wrapped,
so they can be copied as they are.
"""

from __future__ import annotations

import json
import sys
from typing import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

STATUS_STYLE = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skip": "[yellow]skip[/yellow]"}


class Records(Table):
    """A table that never splits a word: printed at a width where every column gets at least its longest word
    (a name, a path, ``torch.nn.functional.grouped_mm``), its cells wrap at spaces only; where that does not
    fit, the same records print one per block instead (the first cell, then each other column as ``column:
    value``), each line whole."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[tuple] = []

    def add_row(self, *cells, **kwargs) -> None:
        self.records.append(cells)
        super().add_row(*cells, **kwargs)

    def __rich_console__(self, console, options):
        widths = self._word_widths(console, options)
        if widths is None:
            yield from self._blocks()
            return
        for column, width in zip(self.columns, widths):
            column.width = width - self._get_padding_width(column._index)
        yield from super().__rich_console__(console, options)

    def _word_widths(self, console, options) -> list[int] | None:
        """Column widths (padding included) that give each column at least its longest word and share the rest
        of the width by what each could still use; None when the longest words alone do not fit."""
        for column in self.columns:
            column.width = None  # measure the cells, not a width set by an earlier print
        ranges = [self._measure_column(console, options, column) for column in self.columns]
        room = options.max_width - self._extra_width
        widths = [r.minimum for r in ranges]
        if sum(widths) > room:
            return None
        spare = room - sum(widths)
        wants = [r.maximum - r.minimum for r in ranges]
        for i, want in enumerate(wants):  # in proportion to what each column still wants, rounded down
            widths[i] += min(want, spare * want // max(1, sum(wants)))
        for i in sorted(range(len(widths)), key=lambda i: wants[i] - (widths[i] - ranges[i].minimum), reverse=True):
            extra = min(room - sum(widths), ranges[i].maximum - widths[i])
            widths[i] += max(0, extra)  # what rounding left over, to the columns that want it most
        return widths

    def _blocks(self):
        heads = [str(c.header) for c in self.columns]
        if self.title:
            yield _whole(f"{self.title}:")
        for cells in self.records:
            lines = [str(cell).replace("\n", " ") if column.no_wrap else str(cell)  # a name and its version
                     for cell, column in zip(cells, self.columns)]
            if len(lines) == 2 and "\n" not in lines[1]:
                yield _whole(f"{lines[0]}: {lines[1]}")
                continue
            yield _whole(lines[0].replace("\n", " "))
            for head, value in zip(heads[1:], lines[1:]):
                parts = value.split("\n")
                if len(parts) == 1:
                    yield _whole(f"  {head}: {value}")
                else:
                    yield _whole(f"  {head}:")
                    yield from (_whole(f"    {part}") for part in parts)


def _whole(markup: str) -> Text:
    """One line that is never wrapped or cut here (a terminal wraps it whole)."""
    text = Text.from_markup(markup)
    text.no_wrap, text.overflow = True, "ignore"
    return text


def table(*columns: str, title: str | None = None, names: tuple[str, ...] = (), right: tuple[str, ...] = (),
          **options) -> Records:
    """A ``Records`` table whose cells wrap at spaces and never split a word (one record per block where the
    words do not fit the width). ``names``: columns of names (plugins, checks, recipes), kept on one line while
    any other column can give way; ``right``: right-justified columns (numbers)."""
    t = Records(title=title, **options)
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


def progress(enabled: bool) -> Callable[[str], None]:
    """``say(line)``: what ``nam train`` is doing before its first step (the recipe, the data, the run folder,
    the build), one line each on stderr, also when it is not a terminal (a CI log shows where a slow start
    is). A no-op when ``enabled`` is False (``--quiet``, ``--json``, every rank but 0)."""
    if not enabled:
        return lambda line: None
    return lambda line: err.print(line, markup=False, highlight=False)


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
