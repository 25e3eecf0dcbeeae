"""The public state of an MCP environment's state folder, JSON-able, for diffs and the UI.

`folder_state(path)` -> `{"files": {relative path: text, or {"bytes", "sha256"} for binary}}`,
plus `"sqlite"` (tables with their columns and first rows, read-only) for SQLite files and
`"git"` (HEAD, branches, recent commits, `status --porcelain`) when the folder is a Git
repository. Bounded (files, characters, rows) so that a step's state stays small; read-only.
"""
from __future__ import annotations

import hashlib
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

MAX_FILES = 200
MAX_CHARS = 2000
MAX_ROWS = 50
SQLITE_MAGIC = b"SQLite format 3\x00"
GIT_TIMEOUT_S = 10.0


def folder_state(root: Path) -> dict[str, Any]:
    """Files, SQLite tables and Git summary of `root` (see the module docstring)."""
    files: dict[str, Any] = {}
    databases: dict[str, Any] = {}
    paths = sorted(p for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts)
    for path in paths[:MAX_FILES]:
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if data.startswith(SQLITE_MAGIC):
            databases[rel] = sqlite_state(path)
            files[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]}
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            files[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16]}
            continue
        files[rel] = text if len(text) <= MAX_CHARS else text[:MAX_CHARS] + f"... ({len(text)} characters)"
    state: dict[str, Any] = {"files": files}
    if len(paths) > MAX_FILES:
        state["files_left_out"] = len(paths) - MAX_FILES
    if databases:
        state["sqlite"] = databases
    if (root / ".git").exists():
        state["git"] = git_state(root)
    return state


def sqlite_state(path: Path) -> dict[str, Any]:
    """Tables of a SQLite file: columns and the first rows (opened read-only)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as exc:
        return {"error": str(exc)}
    try:
        tables: dict[str, Any] = {}
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name")]
        for name in names:
            cursor = conn.execute(f'SELECT * FROM "{name.replace(chr(34), chr(34) * 2)}" LIMIT {MAX_ROWS + 1}')
            rows = [list(r) for r in cursor.fetchall()]
            tables[name] = {"columns": [d[0] for d in cursor.description],
                            "rows": [[_cell(v) for v in r] for r in rows[:MAX_ROWS]]}
            if len(rows) > MAX_ROWS:
                tables[name]["more_rows"] = True
        return tables
    except sqlite3.Error as exc:
        return {"error": str(exc)}
    finally:
        conn.close()


def _cell(value: Any) -> Any:
    return value if not isinstance(value, bytes) else {"bytes": len(value)}


def git(root: Path, *args: str) -> str:
    """`git -C root args...` stdout, stripped; RuntimeError with git's message when it fails."""
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          timeout=GIT_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def git_state(root: Path) -> dict[str, Any]:
    """HEAD, branches, the last commits' subjects and the working tree status."""
    try:
        head = git(root, "symbolic-ref", "--short", "-q", "HEAD") if _has_head_ref(root) else "(detached)"
        branches = git(root, "for-each-ref", "--format=%(refname:short)", "refs/heads").splitlines()
        log = git(root, "log", "--format=%s", "-n", "20").splitlines() if branches else []
        status = git(root, "status", "--porcelain").splitlines()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    return {"head": head, "branches": branches, "log": log, "status": status}


def _has_head_ref(root: Path) -> bool:
    return (root / ".git" / "HEAD").read_text().startswith("ref:")
