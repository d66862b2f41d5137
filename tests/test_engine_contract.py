"""The engine contract (nam_core/engine/contract.py) and the one atomic write (nam_core/files.py)."""

import ast
import errno
from pathlib import Path

import pytest

from nam_core.engine.contract import Engine, engine_for
from nam_core.errors import ConfigError
from nam_core.files import temporary_name, write_atomic, write_json_atomic

ENGINE_DIR = Path(__file__).resolve().parents[1] / "nam_core" / "engine"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_both_engines_implement_the_contract_and_an_unknown_one_is_refused():
    for name in ("local", "megatron"):  # the megatron engine imports on a CPU machine: Megatron loads lazily
        engine = engine_for(name)
        assert isinstance(engine, Engine) and engine.name == name
    with pytest.raises(ConfigError, match="expected one of local, megatron"):
        engine_for("deepspeed")


def test_no_engine_imports_another():
    local = _imports(ENGINE_DIR / "local.py")
    assert not any(m.startswith("nam_core.engine.megatron") for m in local), local
    for path in (ENGINE_DIR / "megatron").glob("*.py"):
        assert "nam_core.engine.local" not in _imports(path), path.name


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_residue(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    write_json_atomic(target, {"steps": 1})
    import nam_core.files as files

    def full_disk(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(files.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, '{"steps": 2}\n')
    assert target.read_text() == '{\n  "steps": 1\n}\n'
    assert not temporary_name(target).exists() and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
