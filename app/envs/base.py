"""The Environment protocol: a stateful set of tools behind one `call` boundary.

Errors come back as results (`ToolResult(error=True)`), as a real API would answer;
bugs in our own code still raise.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

import jsonschema


@dataclass
class Tool:
    """One callable tool as the model sees it."""

    name: str
    """Unique name within an environment, e.g. `mv`."""
    description: str
    """Short, useful description (preambles removed)."""
    parameters: dict[str, Any]
    """JSON schema of the arguments (`{"type": "object", "properties": ..., "required": ...}`)."""
    response: dict[str, Any] | None = None
    """JSON schema of the response, when the tool documents one."""
    read_only: bool = False
    """True when calling it never changes state: safe to shadow-execute on a fork."""
    env_class: str = ""
    """The environment class that owns the tool, e.g. `GorillaFileSystem`."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ToolResult:
    """What one tool call returned."""

    output: Any
    """JSON-able result; for errors `{"error": "..."}`."""
    error: bool = False
    """True when the call failed (unknown tool, bad arguments, the tool raised or returned an error)."""
    missing: str | None = None
    """Why there is no response at all (a recorded environment asked for a call its trace never made,
    `app.envs.recorded`); `output` is then None and the engine records the branch as not executed."""


@runtime_checkable
class Environment(Protocol):
    """A stateful set of tools. One instance per episode; `fork()` for shadow execution.

    Every capability the engine uses is declared here, with a default where an environment may
    lack it: an environment class subclasses `Environment` (or `ToolTable`, which does) and
    overrides what it has, so no caller probes for an attribute."""

    forkable: bool = False
    """True when `fork()` copies the whole state (in memory), so any call, writes included, may
    run on a fork without touching this environment. False when a fork shares a real backend
    (a remote API, a database): only read-only tools may run on it."""

    fork_refusal: str | None = None
    """Why a call that is not read-only does not run on a fork of this environment (shown on the
    branch), when `forkable` is False; None: the engine's general wording."""

    def tools(self) -> list[Tool]:
        """The tools the agent may call now."""
        ...

    def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        """Execute one call. Never raises for bad input: returns `ToolResult(error=True)`."""
        ...

    def fork(self) -> "Environment":
        """An independent deep copy; calls on it never touch this environment."""
        ...

    def state(self) -> dict[str, Any]:
        """Public state (JSON-able), for diffs and success checks."""
        ...

    def set_turn(self, turn: int) -> None:
        """Enter user turn `turn` (BFCL's miss_func tasks add a tool at a later turn); by default the
        tools stay the same."""

    def param_names(self, tool_name: str) -> list[str]:
        """Parameter names of `tool_name` in its documented order (to read positional arguments of a
        ground-truth call string); [] for a tool the environment does not have."""
        tool = next((t for t in self.tools() if t.name == tool_name), None)
        return list(tool.parameters.get("properties", {})) if tool else []

    def close(self) -> None:
        """Release what the environment holds (an MCP server process); by default nothing. Safe to
        call twice."""


Executed = list[tuple[str, dict[str, Any], Any]]
"""The calls committed in a turn, in order: (tool name, arguments, output)."""


@runtime_checkable
class Judge(Protocol):
    """Checks the agent's work at the end of each user turn (`check_turn`), against the task's ground
    truth, state checks or nothing at all (an unjudged instruction)."""

    judges_whole_episode: bool = False
    """True when a turn's verdict covers every turn before it (tau2 judges the final state of the
    whole conversation): the last verdict is the episode's, and a person may add user turns after
    the scripted ones. False: each turn is judged against its own ground truth (BFCL)."""

    def check_turn(self, turn_index: int, env: Environment, executed: Executed) -> TurnCheck:
        """The verdict on turn `turn_index`, given the environment after it and the calls it committed."""
        ...


@dataclass
class TurnCheck:
    """The verdict on one user turn, BFCL-style."""

    success: bool
    state_ok: bool = True
    response_ok: bool = True
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    """A multi-turn task: user turns, environment setup, ground truth, budget."""

    id: str
    """`<suite>:<task id>`, e.g. `bfcl:multi_turn_base_12`."""
    category: str
    """e.g. `multi_turn_base`."""
    turns: list[list[dict[str, str]]]
    """User messages per turn (`{"role": "user", "content": ...}`); a turn may be empty (miss_func)."""
    env_classes: list[str]
    """Environment classes the task uses."""
    initial_config: dict[str, Any] = field(default_factory=dict)
    """Initial state per class."""
    excluded_functions: list[str] = field(default_factory=list)
    """Tools hidden from the agent for this task."""
    ground_truth: list[list[str]] | None = None
    """Ground-truth call strings per turn, e.g. `mv(source='a', destination='b')`."""
    max_steps_per_turn: int = 8
    """Step budget for each user turn."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Suite-specific data (e.g. BFCL's `missed_function`)."""


# ---------------------------------------------------------------- shared by the environments


class ToolTable(Environment):
    """`tools()`, `get_tool`, `param_names` and `set_turn` over a fixed `self._tools` (name -> Tool),
    for environments whose tools do not change with the turn (BFCL's miss_func ones do)."""

    _tools: dict[str, Tool]
    turn: int = 0

    def set_turn(self, turn: int) -> None:
        """Enter user turn `turn`; the tools stay the same."""
        self.turn = turn

    def tools(self) -> list[Tool]:
        """The agent's tools (shared objects: do not mutate)."""
        return list(self._tools.values())

    def get_tool(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def param_names(self, tool_name: str) -> list[str]:
        """Parameter names in the tool's documented order (for positional arguments)."""
        tool = self._tools.get(tool_name)
        return list(tool.parameters.get("properties", {})) if tool else []


def without_null_optionals(tool: Tool, args: dict[str, Any]) -> dict[str, Any]:
    """A JSON null for an optional argument means "not given", as most JSON APIs read it."""
    optional = set(tool.parameters.get("properties", {})) - set(tool.parameters.get("required", []))
    return {k: v for k, v in args.items() if v is not None or k not in optional}


_DRAFT_URIS = {str(cls.META_SCHEMA.get("$id", cls.META_SCHEMA.get("id", ""))).rstrip("#") for cls in (
    jsonschema.Draft3Validator, jsonschema.Draft4Validator, jsonschema.Draft6Validator, jsonschema.Draft7Validator,
    jsonschema.Draft201909Validator, jsonschema.Draft202012Validator)}
"""The meta-schemas `schema_problem` checks against (`$schema` names one, with or without its trailing `#`)."""


def schema_validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    """A validator of instances of `schema`, for the draft its `$schema` names (default 2020-12)."""
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema)


def schema_problem(schema: Any) -> str | None:
    """What makes `schema` not a JSON schema (checked against its draft's meta-schema), one line
    (`where: message`), or None when it is one."""
    if not isinstance(schema, (dict, bool)):
        return f"{json.dumps(schema, default=str)[:60]} is not a JSON schema object"
    if isinstance(schema, bool):
        return None
    meta = schema.get("$schema")
    if meta is not None and (not isinstance(meta, str) or meta.rstrip("#") not in _DRAFT_URIS):
        return (f"$schema: {json.dumps(meta, default=str)[:60]} is not a JSON Schema draft's URI "
                "(leave it out for 2020-12)")
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = ".".join(str(p) for p in exc.path)
        message = " ".join(exc.message.split())
        message = message if len(message) <= 160 else message[:157] + "..."
        return f"{where}: {message}" if where else message
    return None


def argument_problems(validator: jsonschema.protocols.Validator, args: dict[str, Any]) -> str | None:
    """What is wrong with `args` under the tool's schema, one clause per problem in argument order
    (`path: message`; unknown names as "unexpected argument(s)"), or None when they are valid."""
    problems = sorted(validator.iter_errors(args), key=lambda e: list(e.path))
    return "; ".join(_describe(e) for e in problems) or None


def call_problems(name: str, arguments: Any, tools: list[Tool]) -> str | None:
    """What is wrong with a call of `name` with `arguments` among `tools` (an unknown tool, arguments that are
    not an object or break the tool's schema, unknown argument names included), or None when it is valid.
    The environments' own rule: a JSON null for an optional argument means "not given"."""
    tool = next((t for t in tools if t.name == name), None)
    if tool is None:
        names = ", ".join(sorted(t.name for t in tools)) or "none"
        return f"unknown tool {name!r} (this step's tools: {names})"
    if not isinstance(arguments, dict):
        return f"the arguments of {name} must be an object, got {type(arguments).__name__}"
    schema = {"type": "object", **(tool.parameters or {}), "additionalProperties": False}
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)(schema)
    problems = argument_problems(validator, without_null_optionals(tool, arguments))
    return f"invalid arguments for {name}: {problems}" if problems else None


def _describe(error: jsonschema.ValidationError) -> str:
    where = ".".join(str(p) for p in error.path)
    if error.validator == "additionalProperties":
        return error.message.replace("Additional properties are not allowed", "unexpected argument(s)")
    return f"{where}: {error.message}" if where else error.message
