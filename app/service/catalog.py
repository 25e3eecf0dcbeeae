"""What can run: the task catalog, typed instructions, the run request of the Run tab, adapters on disk.

The catalog loads every task once (shared by all sessions); a `RunRequest` resolves to a
task and its judge, or to an `InputError`.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app import envs
from app.config import DEFAULT_MODEL, ROOT
from app.envs.base import Environment, Judge, Task, TurnCheck
from app.engine.history import with_typed_turns
from app.envs import mcp_tasks
from app.envs.bfcl_tasks import CLASS_SOURCES
from app.records import TRACE_PREFIX, Episode, RunSettings
from app.service.forms import InputError


INSTRUCTION_PREFIX = "instruction:"
"""Task ids of typed instructions: `instruction:<EnvClass>` (no ground truth, never judged)."""
INSTRUCTION_BUDGET = 4
"""Steps per turn for a typed instruction (there is no gold sequence to size it from)."""
MCP_SERVERS: tuple[str, ...] = tuple(f"mcp:{name}" for name in mcp_tasks.servers())
"""Environments of a typed instruction on an MCP server (its task file's base setup; never judged)."""
ENV_CLASSES: tuple[str, ...] = tuple(CLASS_SOURCES) + MCP_SERVERS


@dataclass(frozen=True)
class TaskInfo:
    id: str
    category: str
    env_classes: tuple[str, ...]
    first_message: str
    tools: tuple[str, ...] = ()
    """The tools its agent may call (`envs.tool_names`)."""
    user_turns: tuple[str, ...] = ()
    """Every user message, in order."""

    @functools.cached_property
    def search_text(self) -> str:
        """What a task search looks in: id, category, environment classes, tool names, every user message."""
        return "\n".join((self.id, self.category, *self.env_classes, *self.tools, *self.user_turns)).lower()

    def matches(self, query: str) -> bool:
        """Every word of `query` appears in `search_text` (case ignored; an empty query matches)."""
        text = self.search_text
        return all(word in text for word in query.lower().split())


class TaskCatalog:
    """Every runnable task with its category, environment classes and first user message (loaded once)."""

    def __init__(self) -> None:
        self._tasks: dict[str, TaskInfo] | None = None
        self._lock = threading.Lock()

    @property
    def tasks(self) -> dict[str, TaskInfo]:
        with self._lock:
            if self._tasks is None:
                self._tasks = {}
                for task_id in (envs.list_tasks() + envs.list_tasks(suite="mock") + envs.list_tasks(suite="tau2")
                                + envs.list_tasks(suite="mcp")):
                    task = envs.load_task(task_id)
                    said = tuple(m["content"] for turn in task.turns for m in turn)
                    self._tasks[task_id] = TaskInfo(task_id, task.category, tuple(task.env_classes),
                                                    said[0] if said else "", envs.tool_names(task), said)
            return self._tasks

    @property
    def categories(self) -> list[str]:
        return sorted({t.category for t in self.tasks.values()})

    @property
    def env_classes(self) -> list[str]:
        return sorted({c for t in self.tasks.values() for c in t.env_classes})

    def filter(self, env_class: str | None = None, category: str | None = None, query: str = "") -> list[TaskInfo]:
        """Tasks of an environment class and a category (None: any) whose `search_text` has every word of `query`
        (`TaskInfo.matches`)."""
        return [t for t in self.tasks.values()
                if (not env_class or env_class in t.env_classes) and (not category or t.category == category)
                and t.matches(query)]

    def env_classes_of(self, task_id: str) -> tuple[str, ...]:
        if task_id.startswith(INSTRUCTION_PREFIX):
            return tuple(task_id[len(INSTRUCTION_PREFIX):].split("+"))
        info = self.tasks.get(task_id)
        return info.env_classes if info else ()

    def ids_with_class(self, env_class: str) -> list[str]:
        return [t.id for t in self.tasks.values() if env_class in t.env_classes]


class UnjudgedJudge(Judge):
    """The judge of a typed instruction: there is no ground truth, so turns are recorded, not judged."""

    judges_whole_episode = True
    """Any number of user turns may follow (the person speaks as the user); none is judged."""

    def __init__(self, instruction: str) -> None:
        self.instruction = instruction

    def check_turn(self, turn_index: int, env: Any, executed: list) -> TurnCheck:
        return TurnCheck(success=False, details={"judged": False, "instruction": self.instruction,
                                                 "model_calls": len(executed)})


def instruction_task(text: str, env_class: str) -> Task:
    """A one-turn task from a typed instruction on one BFCL environment class (default initial state)."""
    text = (text or "").strip()
    if not text:
        raise InputError("The instruction is empty: type what the agent should do, or pick a benchmark task.")
    if env_class not in ENV_CLASSES:
        raise InputError(f"Pick an environment for the instruction (one of {', '.join(ENV_CLASSES)}).")
    return Task(id=f"{INSTRUCTION_PREFIX}{env_class}", category="instruction",
                turns=[[{"role": "user", "content": text}]], env_classes=[env_class],
                max_steps_per_turn=INSTRUCTION_BUDGET)


def episode_task(episode: Episode) -> Task:
    """The task a stored episode ran, with the user turns it really had: a benchmark task with the turns a
    person typed in place (`with_typed_turns`), a typed instruction rebuilt from the text its verdicts recorded.
    A ValueError says why it cannot be rebuilt (an unknown task, an instruction whose text was never recorded)."""
    task_id = episode.task_id
    if task_id.startswith(TRACE_PREFIX):  # an imported trace: its own turns, tools and recorded calls
        return envs.recorded_task(episode)
    if task_id.startswith(INSTRUCTION_PREFIX) or task_id.endswith(f"/{mcp_tasks.FREE}"):
        text = next((t.details["instruction"] for t in sorted(episode.turn_results, key=lambda t: t.turn)
                     if t.details.get("instruction")), "")
        if not text.strip():
            raise ValueError(f"episode {episode.id} is a typed instruction whose text was never recorded "
                             "(its first turn did not end)")
        if task_id.startswith(INSTRUCTION_PREFIX):
            task = instruction_task(text, task_id[len(INSTRUCTION_PREFIX):])
        else:
            task = mcp_tasks.free_task(task_id.partition(":")[2].rsplit("/", 1)[0], text)
    else:
        task = envs.load_task(task_id)
    turns, typed = with_typed_turns(task.turns, episode.turn_results)
    return dataclasses.replace(task, turns=turns) if typed else task


def task_env(task: Task) -> Environment:
    """A fresh environment of `task`: a typed BFCL instruction names its class, every other task (an MCP
    instruction too) its suite."""
    return envs.BFCLEnvironment.from_task(task) if task.id.startswith(INSTRUCTION_PREFIX) else envs.make_env(task)


def task_turns(task_id: str, episode: Episode | None = None) -> list[list[dict[str, str]]]:
    """User turns of a stored episode's task; the ones a person typed, and typed instructions, come
    from the turn results that recorded them; an imported trace's from its record."""
    if task_id.startswith(TRACE_PREFIX):
        return [list(t) for t in episode.trace.turns] if episode is not None and episode.trace is not None else []
    if task_id.startswith(INSTRUCTION_PREFIX) or task_id.endswith(f"/{mcp_tasks.FREE}"):
        for t in episode.turn_results if episode else []:
            if t.details.get("instruction"):
                return [[{"role": "user", "content": t.details["instruction"]}]]
        return []
    try:
        turns = envs.load_task(task_id).turns
    except ValueError:
        return []
    return with_typed_turns(turns, episode.turn_results if episode else [])[0]


@dataclass(frozen=True)
class RunRequest:
    """What the Run tab asks to run: a task (or typed instruction), a model, and settings."""

    task_id: str | None
    instruction: str = ""
    env_class: str = ""
    model: str = DEFAULT_MODEL
    adapter: str | None = None
    settings: RunSettings = field(default_factory=RunSettings)

    @property
    def key(self) -> str:
        """Equal keys continue the same episode; a different key starts a new one."""
        return json.dumps([self.task_id, self.instruction.strip(), self.env_class, self.model, self.adapter,
                           self.settings.model_dump()], sort_keys=True)

    def task(self) -> tuple[Task, Any]:
        """The task and its judge (None: the suite's own)."""
        if self.task_id:
            try:
                return envs.load_task(self.task_id), None
            except ValueError as exc:
                raise InputError(str(exc)) from None
        if self.env_class in MCP_SERVERS:  # the suite's own environment and judge (which records it unjudged)
            if not self.instruction.strip():
                raise InputError("The instruction is empty: type what the agent should do, or pick a benchmark task.")
            task = mcp_tasks.free_task(self.env_class.partition(":")[2], self.instruction)
            return task, envs.make_judge(task)
        if self.instruction.strip() or self.env_class:
            task = instruction_task(self.instruction, self.env_class)
            return task, UnjudgedJudge(self.instruction.strip())
        raise InputError("No task: pick a benchmark task, or type an instruction and pick its environment.")


def discover_adapters(root: Path = ROOT / "fixtures") -> list[str]:
    """LoRA adapter directories under fixtures/ (any folder holding an adapter_config.json)."""
    if not root.is_dir():
        return []
    return sorted(str(p.parent.relative_to(ROOT)) for p in root.glob("**/adapter_config.json"))
