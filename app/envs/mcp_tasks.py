"""Tasks on MCP servers: a small JSON format, the state-folder setup, and the success check.

A task file (`fixtures/tasks/mcp-<server>.json`, validated by `TaskFile`) names one server
config, a base setup, and tasks. Each task has an instruction (one string, or one per user
turn), its own setup of the state folder (after the base one: files, SQL statements run with
SQLite, then `git` commands with a fixed author and date), checks over the final state folder
(file contents, SQL query rows, `git` output), an optional reference solution (calls per turn,
replayed by the tests to prove each task solvable and its checks right), and a step budget.

Ids: `mcp:<server>/<name>`, e.g. `mcp:git/commit-readme`; `mcp:<server>` names every task of a
server (`list_tasks`). `make_env(task)` builds a fresh state folder in a temporary directory and
starts the server on it (the folder is deleted when the environment closes). `MCPJudge` checks
the state on the task's last turn; earlier turns are recorded as not judged. `free_task(server,
instruction)` is a typed instruction on a server's base setup (never judged).
"""
from __future__ import annotations

import functools
import os
import shutil
import sqlite3
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from app.envs.base import Judge, Task, TurnCheck
from app.envs.bfcl_tasks import UnknownTaskError
from app.envs.mcp import MCPEnvironment, MCPServerConfig
from app.envs.mcp_state import git

SUITE = "mcp"
TASKS_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "tasks"
FREE = "free"
"""The task name of a typed instruction (`mcp:<server>/free`)."""
FREE_BUDGET = 4
# Setup commits get a fixed identity and date, so a task's commit hashes are the same every run.
_GIT_ENV = {"GIT_AUTHOR_NAME": "EnvACE", "GIT_AUTHOR_EMAIL": "envace@example.com",
            "GIT_COMMITTER_NAME": "EnvACE", "GIT_COMMITTER_EMAIL": "envace@example.com",
            "GIT_AUTHOR_DATE": "2026-01-01T12:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T12:00:00Z",
            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _relative(path: str) -> str:
    if not path or Path(path).is_absolute() or ".." in Path(path).parts:
        raise ValueError(f"paths in a task must be relative and stay inside the state folder: {path!r}")
    return path


class Setup(_Model):
    """How to build the state folder, in this order."""

    files: dict[str, str] = Field(default_factory=dict)
    """Relative path -> text content."""
    sql: dict[str, list[str]] = Field(default_factory=dict)
    """SQLite file (relative) -> statements, run in one transaction."""
    git: list[list[str]] = Field(default_factory=list)
    """`git` argument lists run in the folder (e.g. `["init", "-q", "-b", "main"]`)."""

    @field_validator("files", "sql")
    @classmethod
    def _paths(cls, value: dict[str, Any]) -> dict[str, Any]:
        for path in value:
            _relative(path)
        return value


class FileCheck(_Model):
    """A file's content: `equals`, `contains`, or (with `exists: false`) its absence."""

    kind: Literal["file"]
    path: str
    equals: str | None = None
    contains: str | None = None
    exists: bool = True

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return _relative(value)

    def run(self, root: Path) -> tuple[bool, Any]:
        path = root / self.path
        if not self.exists:
            return not path.exists(), "exists" if path.exists() else "absent"
        if not path.is_file():
            return False, "no such file"
        text = path.read_text(encoding="utf-8", errors="replace")
        ok = (self.equals is None or text == self.equals) and (self.contains is None or self.contains in text)
        return ok, text[:300]


class SqlCheck(_Model):
    """A query's rows (as lists, in order) on a SQLite file of the folder (opened read-only)."""

    kind: Literal["sql"]
    db: str
    query: str
    rows: list[list[Any]]

    @field_validator("db")
    @classmethod
    def _db(cls, value: str) -> str:
        return _relative(value)

    def run(self, root: Path) -> tuple[bool, Any]:
        path = root / self.db
        if not path.is_file():
            return False, "no such database"
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = [list(r) for r in conn.execute(self.query).fetchall()]
        except sqlite3.Error as exc:
            return False, f"query failed: {exc}"
        finally:
            conn.close()
        return rows == self.rows, rows[:20]


class GitCheck(_Model):
    """`git <args>` output (stripped): `equals` and/or `contains`."""

    kind: Literal["git"]
    args: list[str]
    equals: str | None = None
    contains: str | None = None

    def run(self, root: Path) -> tuple[bool, Any]:
        try:
            out = git(root, *self.args)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            return False, str(exc)[:300]
        ok = (self.equals is None or out == self.equals) and (self.contains is None or self.contains in out)
        return ok, out[:300]


Check = Annotated[FileCheck | SqlCheck | GitCheck, Field(discriminator="kind")]
_CHECK: TypeAdapter[Check] = TypeAdapter(Check)


class CallSpec(_Model):
    """One call of a reference solution."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arguments")
    @classmethod
    def _identifiers(cls, value: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in value if not k.isidentifier()]
        if bad:
            raise ValueError(f"argument names must be identifiers (for call strings): {bad}")
        return value

    def call_string(self) -> str:
        """BFCL-style `name(k='v', ...)`, which `parse_call_string` reads back."""
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.arguments.items())})"


class TaskSpec(_Model):
    """One task of a task file."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    instruction: str | list[str]
    """The user's message, or one per turn."""
    setup: Setup = Field(default_factory=Setup)
    check: list[Check] = Field(min_length=1)
    solution: list[list[CallSpec]] | None = None
    """Reference calls per turn."""
    max_steps: int = Field(default=6, ge=1, le=32)

    @property
    def turns(self) -> list[str]:
        return [self.instruction] if isinstance(self.instruction, str) else list(self.instruction)


class TaskFile(_Model):
    """A server and its tasks."""

    server: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    """The `<server>` of the ids."""
    description: str = ""
    config: MCPServerConfig
    setup: Setup = Field(default_factory=Setup)
    """The base setup of every task (and of `free_task`)."""
    tasks: list[TaskSpec]


@functools.lru_cache(maxsize=None)
def task_files() -> dict[str, TaskFile]:
    """Every `fixtures/tasks/mcp-*.json`, validated, by server."""
    files: dict[str, TaskFile] = {}
    for path in sorted(TASKS_DIR.glob("mcp-*.json")):
        try:
            spec = TaskFile.model_validate_json(path.read_text(encoding="utf-8"))
        except ValidationError as exc:
            raise ValueError(f"{path.name} is not a valid MCP task file: {exc}") from None
        files[spec.server] = spec
    return files


def servers() -> list[str]:
    return list(task_files())


def _server(name: str) -> TaskFile:
    files = task_files()
    if name not in files:
        raise UnknownTaskError(f"unknown MCP server {name!r}; known: {', '.join(files) or 'none'} "
                               f"(ids like mcp:{next(iter(files), 'git')}/<task>)")
    return files[name]


def list_tasks(server: str | None = None) -> list[str]:
    """Ids of every MCP task, or of one server's."""
    names = [server] if server else servers()
    return [f"{SUITE}:{n}/{t.name}" for n in names for t in _server(n).tasks]


def task_group(spec: str) -> list[str] | None:
    """`mcp` or `mcp:<server>` -> its task ids; None for anything else (a single id, another suite)."""
    if spec == SUITE:
        return list_tasks()
    prefix = f"{SUITE}:"
    if spec.startswith(prefix) and "/" not in spec:
        return list_tasks(spec[len(prefix):])
    return None


def _parse_id(task_id: str) -> tuple[str, str]:
    rest = task_id[len(SUITE) + 1:] if task_id.startswith(f"{SUITE}:") else ""
    server, sep, name = rest.partition("/")
    if not sep or not name:
        raise UnknownTaskError(f"unknown task id {task_id!r}: MCP ids look like mcp:<server>/<task>, "
                               f"e.g. {next(iter(list_tasks()), 'mcp:git/commit-readme')}")
    return server, name


def load_task(task_id: str) -> Task:
    """The task for an id such as `mcp:git/commit-readme`."""
    server, name = _parse_id(task_id)
    spec_file = _server(server)
    spec = next((t for t in spec_file.tasks if t.name == name), None)
    if spec is None:
        raise UnknownTaskError(f"unknown task {task_id!r}; {server} has: {', '.join(t.name for t in spec_file.tasks)}")
    return _task(spec_file, spec)


def _task(spec_file: TaskFile, spec: TaskSpec) -> Task:
    truth = [[c.call_string() for c in turn] for turn in spec.solution] if spec.solution is not None else None
    return Task(id=f"{SUITE}:{spec_file.server}/{spec.name}", category=f"{SUITE}:{spec_file.server}",
                turns=[[{"role": "user", "content": text}] for text in spec.turns],
                env_classes=[f"{SUITE}:{spec_file.server}"], ground_truth=truth,
                max_steps_per_turn=spec.max_steps,
                extra={"mcp": {"server": spec_file.server, "setup": spec.setup.model_dump(),
                               "check": [c.model_dump() for c in spec.check]}})


def free_task(server: str, instruction: str) -> Task:
    """A typed instruction on a server's base setup: one turn, no checks (`MCPJudge` records it unjudged)."""
    text = instruction.strip()
    if not text:
        raise ValueError("the instruction is empty")
    spec_file = _server(server)
    return Task(id=f"{SUITE}:{server}/{FREE}", category=f"{SUITE}:{server}",
                turns=[[{"role": "user", "content": text}]], env_classes=[f"{SUITE}:{server}"],
                max_steps_per_turn=FREE_BUDGET,
                extra={"mcp": {"server": spec_file.server, "setup": Setup().model_dump(), "check": []}})


# ---------------------------------------------------------------- environment and judge


def _spec(task: Task) -> tuple[TaskFile, Setup, list[Check]]:
    data = task.extra.get("mcp")
    if not isinstance(data, dict):
        raise ValueError(f"task {task.id} is not an MCP task")
    checks = [_CHECK.validate_python(c) for c in data["check"]]
    return _server(data["server"]), Setup.model_validate(data["setup"]), checks


def apply_setup(root: Path, setup: Setup) -> None:
    """Write files, run SQL (SQLite), then git commands (fixed identity and date) in `root`."""
    for rel, text in setup.files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    for rel, statements in setup.sql.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(root / rel)
        try:
            with conn:
                for statement in statements:
                    conn.execute(statement)
        finally:
            conn.close()
    for args in setup.git:
        done = subprocess.run(["git", *args], cwd=root, env={**os.environ, **_GIT_ENV}, capture_output=True,
                              text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"task setup: git {' '.join(args)} failed: {done.stderr.strip()}")


def make_env(task: Task) -> MCPEnvironment:
    """A fresh state folder (base setup, then the task's) with the task's server started on it."""
    spec_file, setup, _ = _spec(task)
    root = Path(tempfile.mkdtemp(prefix=f"envace-mcp-{spec_file.server}-"))
    try:
        apply_setup(root, spec_file.setup)
        apply_setup(root, setup)
        return MCPEnvironment.start(spec_file.config, state_dir=root, owns_state=True, name=f"mcp:{spec_file.server}")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


class MCPJudge(Judge):
    """Checks the task's state folder on its last turn; earlier turns are recorded as not judged."""

    def __init__(self, task: Task) -> None:
        self.task = task
        _, _, self.checks = _spec(task)

    def check_turn(self, turn_index: int, env: Any, executed: list) -> TurnCheck:
        details: dict[str, Any] = {"model_calls": len(executed)}
        if not self.checks:  # a typed instruction (`free_task`): recorded, with its text, never judged
            said = [m["content"] for m in self.task.turns[turn_index]] if turn_index < len(self.task.turns) else []
            return TurnCheck(success=False, details={**details, "judged": False, "instruction": " ".join(said)})
        if turn_index < len(self.task.turns) - 1:
            return TurnCheck(success=True, details={**details, "judged": False,
                                                    "note": "MCP tasks are checked on their last turn"})
        if not isinstance(env, MCPEnvironment) or env.state_dir is None:
            raise TypeError(f"MCPJudge needs an MCPEnvironment with a state folder, got {type(env).__name__}")
        root = env.state_dir
        results = []
        for check in self.checks:
            ok, got = check.run(root)
            results.append({"check": check.model_dump(exclude_none=True), "ok": ok, "got": got})
        success = all(r["ok"] for r in results)
        if not success:
            details["error_type"] = "mcp:state_check_failed"
        return TurnCheck(success=success, state_ok=success, details={**details, "checks": results})

__all__ = ["CallSpec", "FREE", "MCPJudge", "Setup", "TaskFile", "TaskSpec", "apply_setup", "free_task",
           "list_tasks", "load_task", "make_env", "servers", "task_files", "task_group"]
