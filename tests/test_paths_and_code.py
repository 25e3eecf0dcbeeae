"""Names and paths from the UI stay inside their folders, and no code path evaluates or unpickles
user or model data."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from app.service.finetune import adapter_dir
from app.service import InputError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["../escape", "..", ".", "/etc/passwd", "a/b", "a\\b", ".hidden", "", " ",
                                  "x" * 81, "name\x00", "ok\nok", "~root", "név"])
def test_adapter_names_cannot_leave_the_adapter_folder(tmp_path: Path, name: str) -> None:
    with pytest.raises(InputError, match="not usable"):
        adapter_dir(name, tmp_path)


def test_an_adapter_name_is_a_new_directory_right_under_the_root(tmp_path: Path) -> None:
    out = adapter_dir("ft-2026.v2_a", tmp_path)
    assert out.parent == tmp_path and not out.exists()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    (tmp_path / "linked").symlink_to(outside)  # dangling: the target does not exist yet
    with pytest.raises(InputError, match="already exists"):
        adapter_dir("linked", tmp_path)
    outside.mkdir()
    with pytest.raises(InputError, match="already exists"):
        adapter_dir("linked", tmp_path)


UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "joblib"}


def python_files() -> list[Path]:
    files = [ROOT / "app.py", *sorted((ROOT / "app").rglob("*.py")), *sorted((ROOT / "model_backend").rglob("*.py"))]
    assert len(files) > 30
    return files


def unsafe_uses(files: list[Path]) -> list[str]:
    """eval/exec/compile, pickle and its kin, `torch.load` without `weights_only=True`, `yaml.load`."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                found += [f"{where} imports {n}" for n in names if n.split(".")[0] in UNSAFE_MODULES]
            if isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in UNSAFE_CALLS:
                    found.append(f"{where} calls {f.id}")
                if isinstance(f, ast.Attribute) and f.attr == "load" and isinstance(f.value, ast.Name):
                    safe = any(k.arg == "weights_only" and getattr(k.value, "value", None) is True for k in node.keywords)
                    if f.value.id == "torch" and not safe or f.value.id == "yaml":
                        found.append(f"{where} calls {f.value.id}.load")
    return found


def test_no_code_path_evaluates_or_unpickles_data() -> None:
    """None in the product's code (BFCL's call strings go through `ast.literal_eval`)."""
    assert unsafe_uses(python_files()) == []


def test_the_code_check_catches_what_it_looks_for(tmp_path: Path) -> None:
    """The check above is not vacuous: a file with each unsafe pattern is flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch\neval('1')\ntorch.load('x')\ntorch.load('y', weights_only=True)\n")
    assert unsafe_uses([bad]) == ["bad.py:1 imports pickle", "bad.py:3 calls eval", "bad.py:4 calls torch.load"]
