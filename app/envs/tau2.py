"""tau2-bench environment: a domain's agent tools over its database, behind one `call` boundary.

Contract:
- One instance per episode, built from tau2's own `get_environment()` for the domain (the DB
  loaded from the package's file), then brought to the task's initial state with tau2's
  `Environment.set_state` (initialization data and actions, as tau2's evaluator does).
- `call(name, args)` never raises for bad input: an unknown tool, arguments that are not an
  object or do not match the tool's schema (unknown names included), a `calculate` expression
  with `**` or over 200 characters (tau2 `eval`s it) and a tool that raises come back as
  `ToolResult({"error": ...}, error=True)`. A valid call goes through tau2's own
  `Environment.get_response` (its exception handling, its `sync_tools`, its JSON rendering); the
  output is that JSON parsed (a plain string when it is not JSON). Every call that reached tau2
  is kept, as tau2 messages, in `trajectory`: the judge hands it to tau2's evaluator.
- `forkable = True`: a fork is an independent copy of the domain DB (telecom: both DBs) with the
  tools rebound to it. The copy is made lazily: a fork and its parent share one tau2
  environment until either runs a call that may write, which first takes its own deep copy
  (reads on airline and retail run on the shared DB, since tau2 marks those tools READ and
  `tests/test_envs_tau2.py` checks every gold read leaves the DB hash unchanged; on telecom
  every call copies, as tau2 runs `sync_tools` after each call).
- `state()` is compact and JSON-able: the records of each DB collection that differ from the
  DB at the start of the episode (`db_changes`; the airline DB is 7 MB, so it is never dumped
  whole), removed keys (`db_removed`), the tau2 DB hash, and on telecom the user's device DB.
"""
from __future__ import annotations

import copy
import json
import logging
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import jsonschema

from app.envs.base import Task, Tool, ToolResult, ToolTable, argument_problems, without_null_optionals
from app.envs.tau2_tasks import domain_tools, new_domain_env, parse_task_id, tau2_task, tau2_module

log = logging.getLogger(__name__)

_ERROR_PREFIX = "Error: "
"""How tau2's `get_response` writes a tool's exception."""


class _Backend:
    """One tau2 environment and the Tau2Environments that share it (copy on write)."""

    def __init__(self, tau2_env: Any, initial: dict[str, Any]) -> None:
        self.env = tau2_env
        self.initial = initial
        """JSON dump of the agent DB at the start of the episode (shared, never mutated)."""
        self.owners: weakref.WeakSet[Tau2Environment] = weakref.WeakSet()
        self.state_cache: dict[str, Any] | None = None

    def detached(self) -> _Backend:
        return _Backend(copy.deepcopy(self.env), self.initial)


class Tau2Environment(ToolTable):
    """The agent tools of one tau2 domain over that domain's DB (see the module docstring)."""

    forkable = True
    """Forks copy the DB (lazily), so writes may run on a fork without touching this environment."""

    def __init__(self, domain: str, initial_state: Any = None) -> None:
        tools = domain_tools(domain)  # validates the domain
        self.domain = domain
        self.turn = 0
        self._tools: dict[str, Tool] = {t.name: t for t in tools}
        tau2_env = new_domain_env(domain)
        if initial_state is not None:
            tau2_env.set_state(initialization_data=initial_state.initialization_data,
                               initialization_actions=initial_state.initialization_actions,
                               message_history=initial_state.message_history or [])
        self.trajectory: list[Any] = list(initial_state.message_history or []) if initial_state is not None else []
        """tau2 messages of every call that reached tau2 (assistant tool call, then tool message)."""
        self._backend = _Backend(tau2_env, tau2_env.tools.db.model_dump(mode="json"))
        self._backend.owners.add(self)

    @classmethod
    def from_task(cls, task: Task) -> Tau2Environment:
        """The environment of a tau2 task, in the task's initial state."""
        domain, _ = parse_task_id(task.id)
        return cls(domain, tau2_task(task.id).initial_state)

    # -- tools -------------------------------------------------------------

    @property
    def tau2_env(self) -> Any:
        """The live tau2 `Environment` (read only: calling its tools bypasses copy on write)."""
        return self._backend.env

    # -- the call boundary -------------------------------------------------

    def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        """Execute one agent call; bad input and tool failures come back as error results."""
        tool = self._tools.get(name)
        if tool is None:
            return ToolResult({"error": f"unknown tool {name!r}"}, error=True)
        if not isinstance(args, dict):
            return ToolResult({"error": f"arguments of {name} must be an object, got {type(args).__name__}"},
                              error=True)
        args = without_null_optionals(tool, args)  # tau2's defaults are None
        problems = argument_problems(_validator(self.domain, name), args)
        if problems:
            return ToolResult({"error": f"invalid arguments for {name}: {problems}"}, error=True)
        refusal = _refuse(name, args)
        if refusal:
            return ToolResult({"error": refusal}, error=True)
        if self._may_write(tool):
            self._own_backend()
        message = tau2_module("tau2.data_model.message")
        tool_call = message.ToolCall(id=f"call_{uuid.uuid4().hex[:12]}", name=name,
                                     arguments=copy.deepcopy(args), requestor="assistant")
        response = self._backend.env.get_response(tool_call)  # catches what the tool raises
        self.trajectory += [message.AssistantMessage(role="assistant", content=None, tool_calls=[tool_call]),
                            response]
        if response.error:
            text = response.content or ""
            return ToolResult({"error": text[len(_ERROR_PREFIX):] if text.startswith(_ERROR_PREFIX) else text},
                              error=True)
        return ToolResult(_parse_content(response.content))

    def _may_write(self, tool: Tool) -> bool:
        # telecom runs sync_tools after every call, which may change either DB.
        return not tool.read_only or self.domain == "telecom"

    def _own_backend(self) -> None:
        """Copy on write: take a private copy of the DB when another environment shares it."""
        if len(self._backend.owners) > 1:
            self._backend.owners.discard(self)
            self._backend = self._backend.detached()
            self._backend.owners.add(self)
        self._backend.state_cache = None

    # -- state -------------------------------------------------------------

    def fork(self) -> Tau2Environment:
        """An independent copy: the DB is shared until either side runs a call that may write."""
        twin = object.__new__(Tau2Environment)
        twin.domain, twin.turn, twin._tools = self.domain, self.turn, self._tools
        twin.trajectory = list(self.trajectory)  # tau2 messages are never mutated
        twin._backend = self._backend
        self._backend.owners.add(twin)
        return twin

    def state(self) -> dict[str, Any]:
        """Records changed since the start of the episode, the DB hash, telecom's device DB."""
        backend = self._backend
        if backend.state_cache is None:
            env = backend.env
            changes, removed = _changes(backend.initial, env.tools.db.model_dump(mode="json"))
            state: dict[str, Any] = {"domain": self.domain, "db_hash": env.get_db_hash(),
                                     "db_changes": changes, "db_removed": removed}
            if env.user_tools is not None:
                state["user_db"] = env.user_tools.db.model_dump(mode="json")
            backend.state_cache = state
        return copy.deepcopy(backend.state_cache)


def make_env(task: Task) -> Tau2Environment:
    """A fresh environment for a tau2 task."""
    return Tau2Environment.from_task(task)


def _changes(initial: Mapping[str, Any], now: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Per top-level DB field: the changed or new records of a mapping (a changed list or value whole)."""
    changes: dict[str, Any] = {}
    removed: dict[str, list[str]] = {}
    for key, value in now.items():
        before = initial.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            changed = {k: v for k, v in value.items() if before.get(k) != v}
            gone = sorted(k for k in before if k not in value)
            if changed:
                changes[key] = changed
            if gone:
                removed[key] = gone
        elif value != before:
            changes[key] = value
    return changes, removed


MAX_EXPRESSION = 200
"""Characters allowed in a `calculate` expression."""


def _refuse(name: str, args: dict[str, Any]) -> str | None:
    """Calls refused before they reach tau2. tau2's `calculate` runs `eval` on any text of digits,
    `+-*/()`, dots and spaces, so `9**9**9**9` would compute for ever in this process (shadow
    execution included): `**` is not among its documented operators, and the length is capped."""
    if name == "calculate":
        expression = str(args.get("expression", ""))
        if "**" in expression:
            return "invalid expression: the operators are +, -, *, / and parentheses (no **)"
        if len(expression) > MAX_EXPRESSION:
            return f"invalid expression: longer than {MAX_EXPRESSION} characters"
    return None


def _parse_content(content: str | None) -> Any:
    if content is None:
        return None
    try:
        return json.loads(content)
    except json.JSONDecodeError:
        return content


_VALIDATORS: dict[tuple[str, str], jsonschema.protocols.Validator] = {}


def _validator(domain: str, tool_name: str) -> jsonschema.protocols.Validator:
    key = (domain, tool_name)
    if key not in _VALIDATORS:
        tool = next(t for t in domain_tools(domain) if t.name == tool_name)
        # Unknown argument names are an error (the Python method would raise TypeError anyway).
        _VALIDATORS[key] = jsonschema.Draft202012Validator({**tool.parameters, "additionalProperties": False})
    return _VALIDATORS[key]
