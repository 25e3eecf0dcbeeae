"""The rehearsing model on its own, for other agents: "what will this call return?" before a real call.

`WorldModel.rehearse(tools, history, call)` predicts one call's response with a confidence;
`WorldModel.propose(tools, history, k)` proposes K candidate calls and rehearses each, as one
parallel step does (same prompts, the same constrained decoding, dedup and selector), without
executing anything. Both plan through the engine's `StepPlanner` on the caller's tools and conversation
(no task, no environment, no judge: nothing is executed), so there is one owner for prompts, parsing and
scoring.

Inputs come from outside (an MCP client): tools in MCP form (`name`, `description`,
`inputSchema`, optional `outputSchema` and `annotations.readOnlyHint`) or OpenAI function form
(`name`, `description`, `parameters`, optionally wrapped in `{"type": "function", "function": ...}`);
history as chat messages (`user`, `assistant` with `content` or one `tool_calls` entry, `tool`
with the result as `content`). Tool schemas are checked against the JSON Schema meta-schema, and the
call to rehearse against its tool's schema. Anything else raises `WorldModelInputError` naming what
to fix.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from app.divergence import is_error
from app.engine.context import StepContext
from app.engine.planner import StepPlanner
from app.envs.base import Tool, argument_problems, schema_problem, schema_validator, without_null_optionals
from app.formats import HistoryItem, call_text, rehearse_target
from app.records import Branch, Call, RunSettings
from model_backend.base import Policy, RemoteCapabilityError

MAX_TOOLS = 64
MAX_HISTORY = 200
MAX_K = 8


class WorldModelInputError(ValueError):
    """Tools, history or a call the world model cannot read; the message says what to fix, on one line (a
    newline in what it quotes, such as a tool's name, is written `\\n`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


@dataclass
class Rehearsal:
    """One predicted response."""

    call: dict[str, Any]
    """`{"name": ..., "arguments": {...}}`."""
    predicted: Any
    """The predicted response (JSON), None when the prediction did not parse."""
    predicted_text: str
    """What the Rehearse role wrote."""
    valid: bool
    """The prediction parsed as JSON."""
    predicts_error: bool
    """The prediction is an `{"error": ...}` response: the model expects this call to fail."""
    confidence: float | None
    """exp(mean token log-probability) of the prediction under the model, in (0, 1]."""
    memory: list[dict[str, Any]] = field(default_factory=list)
    """The real transitions the prediction was conditioned on (tool, arguments, response, source, task_id):
    the rehearsal memory's hits for this call (`app.engine.memory`)."""


@dataclass
class Candidate:
    """One proposed action, rehearsed when it is a call."""

    kind: str
    """`call`, `answer` (plain text to the user) or `parse_error`."""
    action_text: str
    call: dict[str, Any] | None
    score: float
    """The logprob selector's score: mean token log-probability of the action, minus a penalty
    when the rehearsal predicts an error (higher is better)."""
    chosen: bool
    """The candidate the selector would commit."""
    rehearsal: Rehearsal | None


# ---------------------------------------------------------------- input


def parse_tools(raw: Any) -> list[Tool]:
    """Tools in MCP or OpenAI form -> `Tool`s (unique names, object schemas)."""
    if isinstance(raw, str):
        raw = _json(raw, "tools")
    if not isinstance(raw, list) or not raw:
        raise WorldModelInputError("tools must be a non-empty list of tool definitions")
    if len(raw) > MAX_TOOLS:
        raise WorldModelInputError(f"at most {MAX_TOOLS} tools; got {len(raw)}")
    out: dict[str, Tool] = {}
    for i, item in enumerate(raw):
        if isinstance(item, dict) and item.get("type") == "function" and isinstance(item.get("function"), dict):
            item = item["function"]
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"].strip():
            raise WorldModelInputError(f"tools[{i}] needs a string `name`")
        field_name = "inputSchema" if "inputSchema" in item else "parameters"
        schema = item.get(field_name, {"type": "object", "properties": {}})
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise WorldModelInputError(f"tools[{i}] ({item['name']}): the input schema must be a JSON object schema")
        response = item.get("outputSchema")
        if response is not None and not isinstance(response, dict):
            raise WorldModelInputError(f"tools[{i}] ({item['name']}): outputSchema must be a JSON schema object")
        for what, value in ((field_name, schema), ("outputSchema", response)):
            problem = schema_problem(value) if value is not None else None
            if problem:  # checked against the JSON Schema meta-schema: what every reader of the schema assumes
                raise WorldModelInputError(f"tools[{i}] ({item['name']}): {what} is not a valid JSON schema: {problem}")
        hints = item.get("annotations") or {}
        name = item["name"].strip()
        if name in out:
            raise WorldModelInputError(f"two tools are named {name!r}")
        out[name] = Tool(name=name, description=str(item.get("description") or ""),
                         parameters={"type": "object", **schema}, response=response,
                         read_only=bool(isinstance(hints, dict) and hints.get("readOnlyHint")))
    return list(out.values())


def parse_call(raw: Any, tools: list[Tool] | None = None) -> Call:
    """`{"name": ..., "arguments": {...}}` (arguments may be a JSON string, as OpenAI sends them)."""
    if isinstance(raw, str):
        raw = _json(raw, "call")
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise WorldModelInputError('call must be {"name": <tool name>, "arguments": {...}}')
    args = raw.get("arguments", {})
    if isinstance(args, str):
        args = _json(args, "call.arguments")
    if not isinstance(args, dict):
        raise WorldModelInputError("call.arguments must be a JSON object")
    if tools is not None and raw["name"] not in {t.name for t in tools}:
        raise WorldModelInputError(f"unknown tool {raw['name']!r}; the tools are: {', '.join(t.name for t in tools)}")
    return Call(name=raw["name"], arguments=args)


def check_arguments(call: Call, tools: list[Tool]) -> None:
    """The call's arguments fit its tool's input schema (else WorldModelInputError saying what does not); a null
    for an optional argument means "not given", as the environments read it."""
    tool = next(t for t in tools if t.name == call.name)
    problems = argument_problems(schema_validator(tool.parameters), without_null_optionals(tool, call.arguments))
    if problems:
        raise WorldModelInputError(f"call.arguments do not fit the inputSchema of {call.name}: {problems}")


def parse_history(raw: Any) -> list[HistoryItem]:
    """Chat messages -> the conversation the roles read."""
    if raw in (None, ""):
        return []
    if isinstance(raw, str):
        raw = _json(raw, "history")
    if not isinstance(raw, list):
        raise WorldModelInputError("history must be a list of chat messages")
    if len(raw) > MAX_HISTORY:
        raise WorldModelInputError(f"at most {MAX_HISTORY} history messages; got {len(raw)}")
    out: list[HistoryItem] = []
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant", "tool"):
            raise WorldModelInputError(f"history[{i}]: role must be user, assistant or tool")
        content = m.get("content")
        if role == "tool":
            result = _json(content, f"history[{i}].content", strict=False) if isinstance(content, str) else content
            out.append(HistoryItem(role="tool", content="", result=result))
        elif role == "assistant" and m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list) or len(calls) != 1:
                raise WorldModelInputError(f"history[{i}]: one tool call per assistant message")
            call = parse_call(calls[0].get("function", calls[0]) if isinstance(calls[0], dict) else calls[0])
            out.append(HistoryItem(role="assistant", content=call_text(call), call=call))
        else:
            if not isinstance(content, str):
                raise WorldModelInputError(f"history[{i}]: content must be a string")
            out.append(HistoryItem(role=role, content=content))
    return out


def _json(text: Any, what: str, strict: bool = True) -> Any:
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        if not strict:
            return text
        raise WorldModelInputError(f"{what} is not valid JSON: {exc}") from None


# ---------------------------------------------------------------- the model


class WorldModel:
    """A policy's Rehearse (and Act) roles over a caller's tools and conversation."""

    def __init__(self, policy: Policy, *, constrain: bool = True, seed: int = 0, temperature: float = 0.8,
                 max_action_tokens: int = 96, max_rehearsal_tokens: int = 128, memory: Any = None, memory_mode: str = "off") -> None:
        self.policy = policy
        self.memory = memory
        """A `RehearsalMemory` the rehearsals retrieve from (None: prompts without memory), in `memory_mode`
        (RunSettings.memory: off by default, as measured there)."""
        self.base = dict(constrain=constrain, seed=seed, temperature=temperature, shadow=False,
                         max_action_tokens=max_action_tokens, max_rehearsal_tokens=max_rehearsal_tokens,
                         memory=memory_mode)

    def _step(self, tools: list[Tool], history: list[HistoryItem], k: int) -> StepContext:
        """The context of one parallel step (index 0: the seeds of an episode's first step) over the caller's
        tools and conversation, planned outside any episode."""
        settings = RunSettings(mode="parallel", branches=k, selector="logprob", **self.base)
        planner = StepPlanner(self.policy, settings, memory=self.memory)
        return planner.context(0, tools, list(history))

    def rehearse(self, tools: Any, history: Any, call: Any) -> Rehearsal:
        """The predicted response of `call` after `history`, with the model's confidence in it."""
        tool_list = parse_tools(tools)
        parsed = parse_call(call, tool_list)
        check_arguments(parsed, tool_list)
        ctx = self._step(tool_list, parse_history(history), 1)
        branch = Branch(index=0, action_text=call_text(parsed), kind="call", call=parsed)
        ctx.branches = [branch]
        ctx.planner.rehearse(ctx, ctx.branches)
        return self._rehearsals(ctx, ctx.branches)[0]

    def propose(self, tools: Any, history: Any, k: int = 4) -> list[Candidate]:
        """K candidate actions (greedy first, then sampled; duplicates folded), each call rehearsed and
        scored; the one the logprob selector would commit is marked `chosen`."""
        if (isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k) or k != int(k)
                or not 1 <= k <= MAX_K):
            raise WorldModelInputError(f"k must be a whole number from 1 to {MAX_K}; got {k!r}")
        tool_list = parse_tools(tools)
        ctx = self._step(tool_list, parse_history(history), int(k))
        chosen = ctx.planner.plan(ctx)
        calls = [b for b in ctx.branches if b.kind == "call"]
        rehearsals = dict(zip((b.index for b in calls), self._rehearsals(ctx, calls)))
        return [Candidate(kind=b.kind, action_text=b.action_text,
                          call=b.call.model_dump() if b.call is not None else None,
                          score=b.scores.get("logprob", 0.0), chosen=b.index == chosen,
                          rehearsal=rehearsals.get(b.index)) for b in ctx.branches]

    def _rehearsals(self, ctx: StepContext, branches: list[Branch]) -> list[Rehearsal]:
        """Records of the step's rehearsed calls, with one batched scoring pass for their confidence."""
        scored = [b for b in branches if b.predicted is not None and b.index in ctx.rehearse_prompts]
        try:
            logprobs = self.policy.score([ctx.rehearse_prompts[b.index] for b in scored],
                                         [rehearse_target(b.predicted) for b in scored]) if scored else []
        except RemoteCapabilityError:  # a server without prompt log-probabilities: no confidence
            logprobs = []
        confidence = {b.index: round(math.exp(sum(lp) / max(1, len(lp))), 4) for b, lp in zip(scored, logprobs)}
        return [Rehearsal(call=b.call.model_dump(), predicted=b.predicted, predicted_text=b.predicted_text or "",
                          valid=ctx.predicted_valid.get(b.index, False), predicts_error=is_error(b.predicted),
                          confidence=confidence.get(b.index), memory=[h.model_dump() for h in b.memory])
                for b in branches]


def as_dict(value: Rehearsal | Candidate) -> dict[str, Any]:
    return asdict(value)


__all__ = ["Candidate", "Rehearsal", "WorldModel", "WorldModelInputError", "as_dict",
           "parse_call", "parse_history", "parse_tools"]
