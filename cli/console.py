"""Where the CLI writes: tables and results to stdout, diagnostics to stderr."""

from __future__ import annotations

import json
import sys

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

STATUS_STYLE = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skip": "[yellow]skip[/yellow]"}


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
