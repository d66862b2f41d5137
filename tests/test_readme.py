"""Every command in the README works as written, run in the order a newcomer would.

The README's runnable commands are its ```sh blocks. A newcomer runs them in order, each block with only what
the README installed up to that line: here that is one venv holding no nam distribution at first, each README
``pip install`` run in it with ``--no-deps`` (third-party packages, torch included, come from this environment,
whose site folders the venv mirrors without nam's own distributions), and each ``nam`` line run by the venv's
``nam`` script in a scratch folder laid out like the checkout (so ``runs/`` and ``data/`` land there), with a
fresh cache and 80 columns: each must exit 0. The block that runs the test suite is CI's: its command must be
a line of ``.ci/run``, and the torch install line of the first block must be in it. A block whose first line
is ``# on a GPU host`` needs one; it is skipped here and nowhere else.
"""
import os
import re
import shlex
import subprocess
import sys
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
    copy = tmp_path / "checkout"
    copy.mkdir()
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("runs", "data", "build", "dist") \
                and not entry.name.endswith(".egg-info"):
            (copy / entry.name).symlink_to(entry)
    monkeypatch.chdir(copy)
    return copy


# --- the newcomer's path: each block in order, in a venv holding only what the README installed -------------

NAM_DISTRIBUTION = re.compile(r"^(__editable__[._])?(nam_train|nam_plugin_[a-z0-9_]+|nam_cli|nam_core|nam56r)([-_.].*)?$")
"""nam's own distributions in a site-packages folder (dist-info, editable .pth and finder, packages)."""
BUILD_TOOLS = re.compile(r"^(setuptools|pkg_resources|_distutils_hack|distutils-precedence\.pth)([-.].*)?$")


def newcomer_steps(text: str) -> list[tuple[str, list[str]]]:
    """What a newcomer runs, in README order, as ``(kind, argv)``: ``venv`` (make and enter one), ``torch``
    (PyTorch's install line), ``pip`` (any other ``pip install``), ``nam``. Left out: the GPU-host block, and
    the block that runs the test suite (CI's command, checked against .ci/run above, not a newcomer's step).
    Any other command is refused, so a new kind of line in the README gets a way to be checked."""
    steps = []
    for block in sh_blocks(text):
        if block[0].startswith(GPU_BLOCK) or any("python -m pytest" in line for line in block):
            continue
        for line in block:
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                command, words = words[:cut], words[cut + 1:]
                if command[:3] == ["python3", "-m", "venv"] or command[0] in (".", "source"):
                    steps.append(("venv", command))
                elif command[:2] == ["pip", "install"] and any(w.startswith("torch==") for w in command):
                    steps.append(("torch", command))
                elif command[:2] == ["pip", "install"]:
                    steps.append(("pip", command[2:]))
                else:
                    assert command[0] == "nam", f"README command {line!r}: test_readme.py runs nam and pip lines"
                    steps.append(("nam", command[1:]))
    return steps


def test_every_plugin_a_command_needs_was_installed_by_an_earlier_line():
    """Cheap and static, the newcomer's failure of the issue: a block whose own install line forgot a plugin that
    its recipe names (the nam56r dry run needs grouped-moe) works only for a reader who ran the test block."""
    from nam56r.recipes import get_recipe

    installed: set[str] = set()
    for kind, argv in newcomer_steps(README):
        if kind == "pip":
            installed |= {Path(a.split("[")[0]).name.removeprefix("nam-plugin-") for a in argv if "plugins/" in a}
        if kind == "nam" and argv[0] in ("train", "preflight"):
            named = argv[argv.index("--plugins") + 1].split(",") if "--plugins" in argv else []
            recipe = argv[argv.index("--recipe") + 1] if "--recipe" in argv else "nam56r-tiny"
            needed = (set(named) | set(get_recipe(recipe).plugins)) - {"reference"}
            assert needed <= installed, f"`nam {shlex.join(argv)}` needs {sorted(needed - installed)}, not installed"


def site_folders() -> list[str]:
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


def _setuptools_version(folder: str):
    from packaging.version import Version

    found = [Version(p.name.removesuffix(".dist-info").split("-")[1]) for p in Path(folder).glob("setuptools-*.dist-info")]
    return max(found, default=Version("0"))


def readme_venv(root: Path) -> Path:
    """A venv with no nam distribution in it, whose third-party packages (torch, pip, setuptools...) are this
    environment's: each site-packages folder of this interpreter is mirrored by links, nam's distributions
    left out, and the venv adds the mirrors as site folders (a .pth). Only the newest setuptools is mirrored
    (``--no-build-isolation`` builds with it). Returns the venv's python."""
    folders = site_folders()
    builder = max(folders, key=_setuptools_version)
    mirrors = []
    for i, folder in enumerate(folders):
        mirror = root / f"site-{i}"
        mirror.mkdir()
        for entry in os.scandir(folder):
            if not (NAM_DISTRIBUTION.match(entry.name) or (folder != builder and BUILD_TOOLS.match(entry.name))):
                (mirror / entry.name).symlink_to(entry.path)
        mirrors.append(mirror)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    site_packages = next((root / "venv" / "lib").glob("python3*/site-packages"))
    (site_packages / "_environment.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({str(m)!r})" for m in mirrors) + "\n")
    return root / "venv" / "bin" / "python"


def nam_distributions(python: Path) -> set[str]:
    code = ("import importlib.metadata as m; print('\\n'.join(sorted({d.metadata['Name'] for d in m.distributions()"
            " if d.metadata['Name'].startswith('nam-')})))")
    return set(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.split())


@pytest.mark.slow
def test_every_readme_block_works_as_written_with_only_what_the_readme_installed(checkout_copy, tmp_path):
    """Each block in order, in one venv that holds only the nam distributions the README installed up to that
    line (``pip install --no-deps``: third-party packages come from this environment), every ``nam`` command
    run by the venv's ``nam`` script in a copy of the checkout, with a fresh cache, at 80 columns: each exits 0."""
    python = readme_venv(tmp_path)
    assert nam_distributions(python) == set()
    env = {k: v for k, v in os.environ.items() if k not in ("NAM_PLUGINS", "WORLD_SIZE", "NAM_DEBUG", "PYTHONPATH")}
    env.update(NAM_CACHE_DIR=str(tmp_path / "cache"), COLUMNS="80", VIRTUAL_ENV=str(python.parents[1]),
               PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}")
    expected: set[str] = set()
    for kind, argv in newcomer_steps(README):
        if kind == "torch":  # PyTorch comes from this environment: the README's version
            import torch

            wanted = next(a for a in argv if a.startswith("torch==")).split("==")[1]
            assert torch.__version__.split("+")[0] == wanted, f"README installs torch {wanted}, CI has {torch.__version__}"
        elif kind == "pip":
            done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                                   "--no-index", *argv], cwd=checkout_copy, env=env, capture_output=True, text=True)
            assert done.returncode == 0, f"`pip install {shlex.join(argv)}`:\n{done.stderr[-3000:]}"
            expected |= {"nam-train" if a.split("[")[0] in (".", "./") else Path(a.split("[")[0]).name
                         for a in argv if not a.startswith("-")}
            assert nam_distributions(python) == expected  # exactly what the README installed so far
        elif kind == "nam":
            done = subprocess.run([str(python.parent / "nam"), *argv], cwd=checkout_copy, env=env,
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL)
            assert done.returncode == 0, f"`nam {shlex.join(argv)}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert (checkout_copy / "runs" / "nam56r-tiny" / "summary.json").exists()
    assert os.path.isdir(checkout_copy / "data" / "nam56r")
