"""Every command in the README works as written, run in the order a newcomer would.

The README's runnable commands are its ```sh blocks. Their ``nam`` lines run here, in order, through the same
entry point as the console script (``nam_cli.main.run``), in a scratch folder laid out like the checkout (so
``runs/`` and ``data/`` land there) with a fresh cache: each must exit 0. The install lines (``python3 -m venv``,
``pip install``) are what ``.ci/run`` runs, in a fresh venv: the README's test command must be a line of
``.ci/run``, and the torch install line of the first block must be in it. A block whose first line is
``# on a GPU host`` needs one; it is skipped here and nowhere else.
"""

import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
GPU_BLOCK = "# on a GPU host"
INSTALL = ("python3 -m venv", "pip install")


def sh_blocks(text: str) -> list[list[str]]:
    """The README's ```sh blocks, each as its command lines (continuations joined, blank lines dropped)."""
    blocks = []
    for body in re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M):
        lines = body.replace("\\\n", " ").splitlines()
        blocks.append([line.strip() for line in lines if line.strip()])
    return blocks


def nam_commands(text: str) -> list[str]:
    """The ``nam`` commands of the blocks that run anywhere, in README order. Anything else is refused here,
    so a new kind of command in the README gets a way to be checked."""
    commands = []
    for block in sh_blocks(text):
        if block[0].startswith(GPU_BLOCK):
            continue
        for line in block:
            if line.startswith("#") or line.startswith(INSTALL):
                continue
            assert line.startswith("nam "), f"README command {line!r}: test_readme.py runs `nam ...` lines only"
            commands.append(line)
    return commands


def test_the_readme_has_runnable_blocks():
    commands = nam_commands(README)
    assert commands[0].startswith("nam train --max-steps"), "the first thing a newcomer runs is a short train"
    assert any("--device-profile h200" in c and "--dry-run" in c for c in commands)
    assert len(commands) >= 10


def test_ci_runs_the_readmes_install_and_test_lines():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    test_block = next(b for b in sh_blocks(README) if any("python -m pytest" in line for line in b))
    assert test_block[0] in ci  # the README's test command is exactly a line of .ci/run
    torch_line = next(line for line in sh_blocks(README)[0] if line.startswith("pip install torch"))
    torch_cmd = shlex.split(torch_line, comments=True)
    assert "--index-url" in torch_cmd and torch_cmd[torch_cmd.index("--index-url") + 1].endswith("/whl/cpu")
    assert shlex.join(torch_cmd) in test_block[0]  # the newcomer's torch is the one CI installs


@pytest.fixture
def checkout_copy(tmp_path, monkeypatch):
    """A scratch folder that reads like the checkout (its top-level entries linked in) and a fresh cache."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("runs", "data", "build", "dist"):
            (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NAM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "80")
    for var in ("NAM_PLUGINS", "WORLD_SIZE", "NAM_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.mark.slow
def test_every_readme_command_works_as_written(checkout_copy, capsys):
    from nam_cli.main import run

    for command in nam_commands(README):
        argv = shlex.split(command, comments=True)[1:]
        code = run(argv)
        captured = capsys.readouterr()
        assert code == 0, f"`{command}` exited {code}:\n{captured.err[-2000:]}"
    assert (checkout_copy / "runs" / "nam56r-tiny" / "summary.json").exists()
    assert not any(p.is_symlink() and not p.exists() for p in checkout_copy.iterdir())
    assert os.path.isdir(checkout_copy / "data" / "nam56r")
