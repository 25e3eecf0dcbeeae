"""BFCL multi-turn environment: the package's API classes behind one `call` boundary.

One fresh set of instances per episode (BFCL's own executor keeps instances in module
globals and would leak state between episodes, so it is not used).
"""
from __future__ import annotations

import copy
import datetime
import decimal
import enum
import functools
import importlib
import inspect
import json
import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import jsonschema

from app.envs.base import Environment, Task, Tool, ToolResult, argument_problems, without_null_optionals
from app.envs.bfcl_tasks import CLASS_SOURCES, class_tools

log = logging.getLogger(__name__)

_SOURCE_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"


@functools.lru_cache(maxsize=None)
def _api_class(class_name: str) -> type:
    module = importlib.import_module(f"{_SOURCE_PACKAGE}.{CLASS_SOURCES[class_name][0]}")
    return getattr(module, class_name)


@functools.lru_cache(maxsize=None)
def _validator(class_name: str, tool_name: str) -> jsonschema.protocols.Validator:
    tool = next(t for t in class_tools(class_name) if t.name == tool_name)
    # Unknown argument names are an error (the Python method would raise TypeError anyway).
    schema = {**tool.parameters, "additionalProperties": False}
    return jsonschema.Draft7Validator(schema)


class BFCLEnvironment(Environment):
    """The tools of a task's BFCL classes, with fresh instances loaded from its initial config.

    Tools hidden by `excluded_functions`, and `missed_functions` before their turn, are
    neither listed nor callable. `all_tools=True` lifts both (the judge's gold replay).
    """

    forkable = True
    """The API instances live in memory: a fork is a deep copy, so writes may run on it."""

    def __init__(
        self,
        env_classes: Iterable[str],
        initial_config: Mapping[str, Any] | None = None,
        *,
        excluded_functions: Iterable[str] = (),
        missed_functions: Mapping[str, Iterable[str]] | None = None,
        long_context: bool = False,
        all_tools: bool = False,
    ) -> None:
        self.env_classes = list(env_classes)
        unknown = [c for c in self.env_classes if c not in CLASS_SOURCES]
        if unknown:
            raise ValueError(f"unknown BFCL classes {unknown}; known: {', '.join(CLASS_SOURCES)}")
        self.long_context = long_context
        self.all_tools = all_tools
        self.turn = 0
        self._excluded = frozenset(excluded_functions)
        # Tool name -> first turn at which it becomes available (miss_func).
        self._available_from: dict[str, int] = {
            name: int(turn) for turn, names in (missed_functions or {}).items() for name in names
        }
        self._tools: dict[str, Tool] = {t.name: t for c in self.env_classes for t in class_tools(c)}
        self._initial_config: dict[str, Any] = copy.deepcopy(dict(initial_config or {}))
        self._instances: dict[str, Any] = {}
        self.reset()

    @classmethod
    def from_task(cls, task: Task, *, all_tools: bool = False) -> BFCLEnvironment:
        """The environment for a BFCL task, at turn 0."""
        return cls(
            task.env_classes,
            task.initial_config,
            excluded_functions=task.excluded_functions,
            missed_functions=task.extra.get("missed_function") or {},
            long_context=bool(task.extra.get("long_context")),
            all_tools=all_tools,
        )

    def reset(self, initial_config: Mapping[str, Any] | None = None) -> None:
        """Fresh instances, loaded from `initial_config` (default: the one given at construction)."""
        if initial_config is not None:
            self._initial_config = copy.deepcopy(dict(initial_config))
        self._instances = {}
        for class_name in self.env_classes:
            instance = _api_class(class_name)()
            if hasattr(instance, "_load_scenario"):  # MathAPI is stateless and has none
                # Deep copy: _load_scenario keeps references to the dicts it is given.
                config = copy.deepcopy(self._initial_config.get(class_name, {}))
                instance._load_scenario(config, long_context=self.long_context)
            self._instances[class_name] = instance

    # -- tools -------------------------------------------------------------

    def set_turn(self, turn: int) -> None:
        """Enter user turn `turn` (0-based); miss_func tools appear from their turn on."""
        self.turn = turn

    def available_tools(self, turn: int) -> list[Tool]:
        """The tools the agent may call during `turn`."""
        return [t for t in self._tools.values() if self._is_available(t.name, turn)]

    def tools(self) -> list[Tool]:
        """The tools the agent may call now (shared objects: do not mutate)."""
        return self.available_tools(self.turn)

    def get_tool(self, name: str) -> Tool | None:
        """The tool called `name` if it is available now, else None."""
        return self._tools[name] if self._is_available(name, self.turn) else None

    def param_names(self, tool_name: str) -> list[str]:
        """Parameter names of a tool in the Python method's order (for positional arguments)."""
        tool = self._tools.get(tool_name)
        if tool is None:
            return []
        method = getattr(self._instances[tool.env_class], tool_name)
        return list(inspect.signature(method).parameters)

    def _is_available(self, name: str, turn: int) -> bool:
        if name not in self._tools:
            return False
        if self.all_tools:
            return True
        return name not in self._excluded and self._available_from.get(name, 0) <= turn

    # -- the call boundary -------------------------------------------------

    def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        """Execute one call; bad input and tool failures come back as error results."""
        tool = self.get_tool(name)
        if tool is None:
            return ToolResult({"error": f"unknown tool {name!r}"}, error=True)
        if not isinstance(args, dict):
            return ToolResult({"error": f"arguments of {name} must be an object, got {type(args).__name__}"}, error=True)
        args = without_null_optionals(tool, args)
        problems = argument_problems(_validator(tool.env_class, name), args)
        if problems:
            return ToolResult({"error": f"invalid arguments for {name}: {problems}"}, error=True)
        method = getattr(self._instances[tool.env_class], name)
        try:
            # A copy: tools store argument lists (e.g. tweet tags) inside their state.
            raw = method(**copy.deepcopy(args))
        except Exception as exc:  # the third-party tool failed: the model sees it, as BFCL does
            log.debug("tool %s raised %r", name, exc)
            return ToolResult({"error": f"{type(exc).__name__}: {exc}"}, error=True)
        # Convert now: tools return references to live state, which later calls mutate.
        output = to_jsonable(raw)
        return ToolResult(output, error=isinstance(output, dict) and "error" in output)

    # -- state -------------------------------------------------------------

    def fork(self) -> BFCLEnvironment:
        """An independent deep copy (instances, turn and visibility included)."""
        # Tools are immutable in practice: sharing them makes a fork about 10x cheaper.
        return copy.deepcopy(self, {id(tool): tool for tool in self._tools.values()})

    def state(self) -> dict[str, Any]:
        """Public attributes (no leading underscore) of every instance, JSON-able, by class; the file system's
        working directory too (private in `GorillaFileSystem`, yet it decides what `cat`, `ls` or `cd` answer),
        under the name its `pwd` tool uses."""
        out = {}
        for name, inst in self._instances.items():
            out[name] = {k: to_jsonable(v) for k, v in vars(inst).items() if not k.startswith("_")}
            if hasattr(inst, "_current_dir") and callable(getattr(inst, "pwd", None)):
                out[name]["current_working_directory"] = inst.pwd()["current_working_directory"]
        return out

    @property
    def instances(self) -> dict[str, Any]:
        """The live API instances by class name, for the judge's state check (do not mutate)."""
        return dict(self._instances)


def make_env(task: Task) -> BFCLEnvironment:
    """A fresh environment for a BFCL task."""
    return BFCLEnvironment.from_task(task)


def to_jsonable(value: Any, _ancestors: frozenset[int] = frozenset()) -> Any:
    """A JSON-able copy of a tool result or state value (tuples and sets become lists)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # NaN/inf are not JSON
    if isinstance(value, dict):
        return {_key(k): to_jsonable(v, _ancestors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v, _ancestors) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [to_jsonable(v, _ancestors) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, numbers.Real)):  # e.g. mpmath's mpf
        return to_jsonable(float(value))
    if isinstance(value, numbers.Complex):  # e.g. the log of a negative number
        return str(value)
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, _ancestors)
    fs = importlib.import_module(f"{_SOURCE_PACKAGE}.gorilla_file_system")
    # The file system's tree, in the same shape as BFCL's scenario files.
    if isinstance(value, fs.File):
        return {"type": "file", "content": value.content}
    if isinstance(value, fs.Directory):
        return {"type": "directory", "contents": to_jsonable(value.contents, _ancestors)}
    public = {k: v for k, v in getattr(value, "__dict__", {}).items() if not k.startswith("_")}
    if public and id(value) not in _ancestors:
        inner = _ancestors | {id(value)}
        return {k: to_jsonable(v, inner) for k, v in public.items()}
    return str(value)


def _key(key: Any) -> str:
    return key if isinstance(key, str) else str(key)
