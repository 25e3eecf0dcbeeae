"""Environments: the protocol, the BFCL multi-turn adapter, tau2-bench, MCP servers, a mock, and a
registry by id prefix.

`load_task("bfcl:multi_turn_base_12")`, `make_env(task)` and `make_judge(task)` dispatch on
the part of the id before the colon (`bfcl:`, `tau2:`, `mcp:`, `mock:`, `trace:`) through `SUITE_TABLE`. `task_group("mcp:git")`
expands a group name to its task ids (None for a single id).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from app.envs.base import Environment, Judge, Task
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

def _mock_task(task_id: str) -> Task:
    if task_id != MOCK_TASK_ID:
        raise UnknownTaskError(f"unknown mock task {task_id!r}; the only one is {MOCK_TASK_ID}")
    return mock_task()


def _mock_list(category: str | None, split: str | None) -> list[str]:
    return [MOCK_TASK_ID] if category in (None, "mock") and split is None else []


def _mcp_list(category: str | None, split: str | None) -> list[str]:
    if split is not None:
        raise UnknownTaskError(f"MCP tasks have no {split} split")
    return mcp_tasks.list_tasks(category)


def _bfcl_tool_names(task: Task) -> tuple[str, ...]:
    from app.envs.bfcl_tasks import class_tools

    excluded = set(task.excluded_functions)
    return tuple(t.name for c in task.env_classes for t in class_tools(c) if t.name not in excluded)


def _mcp_tool_names(task: Task) -> tuple[str, ...]:
    # Only a running server lists its tools: the ones the task's reference solution calls.
    return tuple(dict.fromkeys(call.partition("(")[0].strip() for turn in task.ground_truth or [] for call in turn))


def _trace_task(task_id: str) -> Task:
    raise UnknownTaskError(f"{task_id!r} is an imported trace: its task is rebuilt from its stored episode "
                           "(`recorded_task`), not loaded by id")


def _trace_list(category: str | None, split: str | None) -> list[str]:
    return []  # imported traces live in the store, not in a task list


@dataclass(frozen=True)
class Suite:
    """What the registry needs of a suite of tasks, by the id prefix before the colon."""

    load_task: Callable[[str], Task]
    list_tasks: Callable[[str | None, str | None], list[str]]
    """(category, split) -> task ids."""
    make_env: Callable[[Task], Environment]
    make_judge: Callable[[Task], Judge]
    tool_names: Callable[[Task], tuple[str, ...]]
    """The names of the tools a task's agent may call, without starting anything."""


SUITE_TABLE: dict[str, Suite] = {
    "bfcl": Suite(load_bfcl_task, list_bfcl_tasks, make_bfcl_env, BFCLJudge, _bfcl_tool_names),
    "mock": Suite(_mock_task, _mock_list, make_mock_env, MockJudge,
                  lambda task: tuple(t.name for t in make_mock_env(task).tools())),
    "tau2": Suite(tau2_tasks.load_task, tau2_tasks.list_tasks, Tau2Environment.from_task, Tau2Judge,
                  lambda task: tuple(t.name for t in tau2_tasks.domain_tools(task.category))),
    "mcp": Suite(mcp_tasks.load_task, _mcp_list, mcp_tasks.make_env, mcp_tasks.MCPJudge, _mcp_tool_names),
    TRACE_PREFIX.rstrip(":"): Suite(_trace_task, _trace_list, RecordedEnvironment.from_task, RecordedJudge,
                                    lambda task: tuple(t.name for t in RecordedEnvironment.from_task(task).tools())),
}
"""Every suite by its id prefix: the one place a new kind of task is registered."""
SUITES: tuple[str, ...] = ("bfcl", "mock", "tau2", "mcp")
"""The suites whose tasks are listed and loaded by id (imported traces are rebuilt from their episodes)."""


def _suite(task_id: str) -> Suite:
    name, sep, _ = task_id.partition(":")
    if not sep or name not in SUITE_TABLE:
        raise UnknownTaskError(
            f"unknown task id {task_id!r}: expected a prefix of {', '.join(s + ':' for s in SUITES)}; "
            f"BFCL categories: {', '.join(CATEGORIES)}"
        )
    return SUITE_TABLE[name]


def load_task(task_id: str) -> Task:
    """The task for an id such as `bfcl:multi_turn_base_12` or `mock:kv`."""
    return _suite(task_id).load_task(task_id)


def list_tasks(category: str | None = None, split: str | None = None, *, suite: str = "bfcl") -> list[str]:
    """Task ids of a suite (BFCL by default), optionally of one category and/or split
    (tau2: the category is the domain; mcp: the category is a server, `git`, `sqlite` or
    `filesystem`, and MCP tasks have no split)."""
    if suite not in SUITES:
        raise UnknownTaskError(f"unknown suite {suite!r}; known: {', '.join(SUITES)}")
    return SUITE_TABLE[suite].list_tasks(category, split)


def make_env(task: Task) -> Environment:
    """A fresh environment for the task, at turn 0 (every kind also has `set_turn(turn)`).

    An MCP environment runs a server process: close it (`env.close()`) when done; garbage
    collection and interpreter exit close it too. An imported trace's task (`recorded_task`) answers from its
    recording."""
    return _suite(task.id).make_env(task)


def make_judge(task: Task) -> Judge:
    """A fresh per-episode judge for the task (`check_turn(turn_index, env, executed)`)."""
    return _suite(task.id).make_judge(task)


def tool_names(task: Task) -> tuple[str, ...]:
    """The names of the tools a task's agent may call, without starting anything: a BFCL class's documented tools
    (less the task's excluded ones), a tau2 domain's toolkit, the mock's, an imported trace's recorded tools; for an
    MCP task (whose tools only its running server lists) the tools its reference solution calls."""
    return _suite(task.id).tool_names(task)


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
    "SUITE_TABLE",
    "Suite",
    "BFCLEnvironment",
    "BFCLJudge",
    "CATEGORIES",
    "Environment",
    "Judge",
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
