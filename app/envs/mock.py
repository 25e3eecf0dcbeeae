"""A tiny in-memory key-value environment, task and judge for the engine's unit tests."""
from __future__ import annotations

import copy
import functools
from typing import Any

import jsonschema

from app.envs.base import Environment, Task, Tool, ToolResult
from app.envs.bfcl_check import ReplayJudge

MOCK_TASK_ID = "mock:kv"
MOCK_CLASS = "MockKV"

_KEY = {"type": "string", "description": "The key."}
_TOOLS: tuple[Tool, ...] = (
    Tool(
        "get", "Read the value stored under a key.",
        {"type": "object", "properties": {"key": _KEY}, "required": ["key"]},
        {"type": "object", "properties": {"value": {"description": "The stored value."}}},
        read_only=True, env_class=MOCK_CLASS,
    ),
    Tool(
        "set", "Store a value under a key, replacing any previous value.",
        {"type": "object", "properties": {"key": _KEY, "value": {"description": "Any JSON value."}}, "required": ["key", "value"]},
        {"type": "object", "properties": {"ok": {"type": "boolean"}}},
        env_class=MOCK_CLASS,
    ),
    Tool(
        "delete", "Remove a key.",
        {"type": "object", "properties": {"key": _KEY}, "required": ["key"]},
        {"type": "object", "properties": {"deleted": {"type": "string"}}},
        env_class=MOCK_CLASS,
    ),
    Tool(
        "list_keys", "List all keys, sorted.",
        {"type": "object", "properties": {}, "required": []},
        {"type": "object", "properties": {"keys": {"type": "array", "items": {"type": "string"}}}},
        read_only=True, env_class=MOCK_CLASS,
    ),
    Tool(
        "fail", "Always fails (exercises the error path).",
        {"type": "object", "properties": {}, "required": []},
        None,
        env_class=MOCK_CLASS,
    ),
)


@functools.lru_cache(maxsize=None)
def _validator(tool_name: str) -> jsonschema.Draft7Validator:
    tool = next(t for t in _TOOLS if t.name == tool_name)
    return jsonschema.Draft7Validator({**tool.parameters, "additionalProperties": False})


class MockEnvironment(Environment):
    """A key-value store behind the Environment protocol.

    `forkable=False` makes it stand in for an environment whose forks share a real backend
    (the engine then shadow-executes only read-only calls); its forks stay in-memory copies.
    """

    def __init__(self, initial_state: dict[str, Any] | None = None, *, forkable: bool = True) -> None:
        self.forkable = forkable
        self.turn = 0
        self.store: dict[str, Any] = {}
        self.reset(initial_state)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Start over from `{"store": {...}}` (or empty)."""
        self.store = copy.deepcopy(dict((initial_state or {}).get("store", {})))

    def set_turn(self, turn: int) -> None:
        """Enter user turn `turn`; the mock's tools never change with the turn."""
        self.turn = turn

    def tools(self) -> list[Tool]:
        return list(_TOOLS)

    def get_tool(self, name: str) -> Tool | None:
        return next((t for t in _TOOLS if t.name == name), None)

    def param_names(self, tool_name: str) -> list[str]:
        tool = self.get_tool(tool_name)
        return list(tool.parameters["properties"]) if tool else []

    def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        if self.get_tool(name) is None:
            return ToolResult({"error": f"unknown tool {name!r}"}, error=True)
        if not isinstance(args, dict):
            return ToolResult({"error": f"arguments of {name} must be an object"}, error=True)
        problems = [e.message for e in _validator(name).iter_errors(args)]
        if problems:
            return ToolResult({"error": f"invalid arguments for {name}: {'; '.join(problems)}"}, error=True)
        try:
            output = getattr(self, f"_tool_{name}")(**copy.deepcopy(args))
        except (KeyError, RuntimeError) as exc:  # the tools' own failures, as an API answers them
            return ToolResult({"error": f"{type(exc).__name__}: {exc}"}, error=True)
        return ToolResult(output, error="error" in output)

    def _tool_get(self, key: str) -> dict[str, Any]:
        if key not in self.store:
            return {"error": f"no such key: {key}"}
        return {"value": copy.deepcopy(self.store[key])}

    def _tool_set(self, key: str, value: Any) -> dict[str, Any]:
        self.store[key] = value
        return {"ok": True}

    def _tool_delete(self, key: str) -> dict[str, Any]:
        del self.store[key]  # KeyError for a missing key comes back as an error result
        return {"deleted": key}

    def _tool_list_keys(self) -> dict[str, Any]:
        return {"keys": sorted(self.store)}

    def _tool_fail(self) -> dict[str, Any]:
        raise RuntimeError("this tool always fails")

    def fork(self) -> MockEnvironment:
        return copy.deepcopy(self)

    def state(self) -> dict[str, Any]:
        return {MOCK_CLASS: {"store": copy.deepcopy(self.store)}}


def mock_task() -> Task:
    """A two-turn task on the key-value store, with ground truth."""
    return Task(
        id=MOCK_TASK_ID,
        category="mock",
        turns=[
            [{"role": "user", "content": "Store the colour 'blue' under the key 'color'."}],
            [{"role": "user", "content": "Remove the key 'size', then tell me the stored colour."}],
        ],
        env_classes=[MOCK_CLASS],
        initial_config={MOCK_CLASS: {"store": {"size": "L"}}},
        ground_truth=[
            ["set(key='color', value='blue')"],
            ["delete(key='size')", "get(key='color')"],
        ],
        max_steps_per_turn=4,
    )


def make_mock_env(task: Task) -> MockEnvironment:
    """A fresh key-value store loaded with the task's initial state."""
    return MockEnvironment(task.initial_config.get(MOCK_CLASS))


class MockJudge(ReplayJudge):
    """BFCL-style check on the mock: gold replay, then state and response comparison."""

    def __init__(self, task: Task) -> None:
        super().__init__(task, make_mock_env(task))

    def state_differences(self, env: Any) -> dict[str, Any]:
        model, gold = env.state()[MOCK_CLASS], self._gold_env.state()[MOCK_CLASS]  # type: ignore[attr-defined]
        return {} if model == gold else {MOCK_CLASS: {"model": model, "ground_truth": gold}}
