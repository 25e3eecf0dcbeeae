"""Environments: the protocol, the BFCL multi-turn adapter, tau2-bench, MCP servers, a mock, and a
registry by id prefix.

`load_task("bfcl:multi_turn_base_12")`, `make_env(task)` and `make_judge(task)` dispatch on
the part of the id before the colon (`bfcl:`, `tau2:`, `mcp:`, `mock:`). `task_group("mcp:git")`
expands a group name to its task ids (None for a single id).
"""
from __future__ import annotations

from app.envs.base import Environment, Task
from app.envs.bfcl import BFCLEnvironment
from app.envs.bfcl import make_env as make_bfcl_env
from app.envs.bfcl_check import BFCLJudge, ReplayJudge, replay_ground_truth
from app.envs.bfcl_tasks import CATEGORIES, READ_ONLY_TOOLS, UnknownTaskError, parse_call_string
from app.envs.bfcl_tasks import list_tasks as list_bfcl_tasks
from app.envs.bfcl_tasks import load_task as load_bfcl_task
from app.envs.mock import MOCK_TASK_ID, MockEnvironment, MockJudge, make_mock_env, mock_task
# tau2-bench (airline, retail, telecom): ids like `tau2:airline/0`.
from app.envs import tau2_tasks
from app.envs.tau2 import Tau2Environment
from app.envs.tau2_check import Tau2Judge

# MCP servers (git, sqlite, filesystem): ids like `mcp:git/commit-readme`.
from app.envs import mcp_tasks
from app.envs.mcp import MCPEnvironment, MCPServerConfig, MCPStartError

# Imported traces (`app.trace_io`): ids like `trace:otlp/<trace id>`, rebuilt from their episode (`recorded_task`).
from app.envs.recorded import RecordedEnvironment, RecordedJudge, recorded_task
from app.records import TRACE_PREFIX

SUITES: tuple[str, ...] = ("bfcl", "mock", "tau2", "mcp")


def _suite(task_id: str) -> str:
    suite, sep, _ = task_id.partition(":")
    if not sep or suite not in SUITES:
        raise UnknownTaskError(
            f"unknown task id {task_id!r}: expected a prefix of {', '.join(s + ':' for s in SUITES)}; "
            f"BFCL categories: {', '.join(CATEGORIES)}"
        )
    return suite


def load_task(task_id: str) -> Task:
    """The task for an id such as `bfcl:multi_turn_base_12` or `mock:kv`."""
    if _suite(task_id) == "bfcl":
        return load_bfcl_task(task_id)
    if _suite(task_id) == "tau2":
        return tau2_tasks.load_task(task_id)
    if _suite(task_id) == "mcp":
        return mcp_tasks.load_task(task_id)
    if task_id != MOCK_TASK_ID:
        raise UnknownTaskError(f"unknown mock task {task_id!r}; the only one is {MOCK_TASK_ID}")
    return mock_task()


def list_tasks(category: str | None = None, split: str | None = None, *, suite: str = "bfcl") -> list[str]:
    """Task ids of a suite (BFCL by default), optionally of one category and/or split
    (tau2: the category is the domain; mcp: the category is a server, `git`, `sqlite` or
    `filesystem`, and MCP tasks have no split)."""
    if suite == "bfcl":
        return list_bfcl_tasks(category, split)
    if suite == "tau2":
        return tau2_tasks.list_tasks(category, split)
    if suite == "mcp":
        if split is not None:
            raise UnknownTaskError(f"MCP tasks have no {split} split")
        return mcp_tasks.list_tasks(category)
    if suite == "mock":
        return [MOCK_TASK_ID] if category in (None, "mock") and split is None else []
    raise UnknownTaskError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")


def make_env(task: Task) -> Environment:
    """A fresh environment for the task, at turn 0 (every kind also has `set_turn(turn)`).

    An MCP environment runs a server process: close it (`env.close()`) when done; garbage
    collection and interpreter exit close it too. An imported trace's task (`recorded_task`) answers from its
    recording."""
    if task.id.startswith(TRACE_PREFIX):
        return RecordedEnvironment.from_task(task)
    if _suite(task.id) == "tau2":
        return Tau2Environment.from_task(task)
    if _suite(task.id) == "mcp":
        return mcp_tasks.make_env(task)
    return make_bfcl_env(task) if _suite(task.id) == "bfcl" else make_mock_env(task)


def make_judge(task: Task) -> ReplayJudge | Tau2Judge | mcp_tasks.MCPJudge:
    """A fresh per-episode judge for the task (`check_turn(turn_index, env, executed)`)."""
    if task.id.startswith(TRACE_PREFIX):
        return RecordedJudge(task)
    if _suite(task.id) == "tau2":
        return Tau2Judge(task)
    if _suite(task.id) == "mcp":
        return mcp_tasks.MCPJudge(task)
    return BFCLJudge(task) if _suite(task.id) == "bfcl" else MockJudge(task)


def tool_names(task: Task) -> tuple[str, ...]:
    """The names of the tools a task's agent may call, without starting anything: a BFCL class's documented tools
    (less the task's excluded ones), a tau2 domain's toolkit, the mock's; for an MCP task (whose tools only its
    running server lists) the tools its reference solution calls."""
    suite = _suite(task.id)
    if suite == "bfcl":
        from app.envs.bfcl_tasks import class_tools

        excluded = set(task.excluded_functions)
        return tuple(t.name for c in task.env_classes for t in class_tools(c) if t.name not in excluded)
    if suite == "tau2":
        return tuple(t.name for t in tau2_tasks.domain_tools(task.category))
    if suite == "mcp":
        return tuple(dict.fromkeys(call.partition("(")[0].strip() for turn in task.ground_truth or [] for call in turn))
    return tuple(t.name for t in make_mock_env(task).tools())


def task_group(spec: str, split: str | None = None) -> list[str] | None:
    """The task ids a group name stands for (`mcp`, `mcp:git`, `tau2`, `tau2:airline`), optionally of
    one split (tau2 only: `train` or `heldout`), or None when `spec` is not a group."""
    if spec == "tau2" or (spec.startswith("tau2:") and "/" not in spec):
        return tau2_tasks.list_tasks(spec.partition(":")[2] or None, split)
    group = mcp_tasks.task_group(spec)
    if group is not None and split is not None:
        raise UnknownTaskError(f"{spec} tasks have no {split} split (MCP tasks are not split)")
    return group


__all__ = [
    "BFCLEnvironment",
    "BFCLJudge",
    "CATEGORIES",
    "Environment",
    "MCPEnvironment",
    "MCPServerConfig",
    "MCPStartError",
    "MOCK_TASK_ID",
    "MockEnvironment",
    "MockJudge",
    "READ_ONLY_TOOLS",
    "RecordedEnvironment",
    "RecordedJudge",
    "Tau2Environment",
    "Tau2Judge",
    "Task",
    "UnknownTaskError",
    "list_tasks",
    "load_task",
    "make_env",
    "make_judge",
    "mock_task",
    "parse_call_string",
    "recorded_task",
    "replay_ground_truth",
    "task_group",
    "tool_names",
]
