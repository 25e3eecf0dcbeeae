"""Prompt rendering for the two roles, and parsing of `<tool_call>` / `<execution_result>`.

Prompts are ordered so that what the K branches share comes first (system text,
history) and what differs comes last (the call to rehearse): the policy encodes the
shared prefix once and reuses its KV cache across branches.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Sequence

from app.envs.base import Tool
from app.records import Call
from model_backend.base import Constraint, Prompt

CountTokens = Callable[[str], int]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<execution_result>", "</execution_result>"
ACT_STOP = (TOOL_CALL_CLOSE,)
REHEARSE_STOP = (RESULT_CLOSE,)
RESULT_CHARS = 400
"""Tool results in prompts are cut to this many characters (NOTES.md: keeps Act prompts near 1k tokens)."""

ACT_SYSTEM = """You are an assistant that completes the user's request by calling tools.
Tools, one per line as name(argument: type, optional?: type): purpose
{tools}

To call a tool, reply with only one call in this exact form:
<tool_call>{{"name": "tool_name", "arguments": {{"argument": "value"}}}}</tool_call>
You then see the tool's result. Call one tool per reply. When the request is done, reply to the user in plain text."""

REHEARSE_SYSTEM = """You simulate tools. Given the calls made so far with their real results, predict exactly what the next call returns.
Reply with the JSON response inside <execution_result></execution_result>. A failed call returns {"error": "message"}."""

JUDGE_SYSTEM = """You review an assistant's proposed tool call and the result it expects.
Answer yes if the call makes progress on the user's request without error, otherwise no."""


# ---------------------------------------------------------------- canonical JSON


def canonical_json(value: Any) -> str:
    """One spelling per value: sorted keys, no spaces (used for exact match and dedup)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def canonical_call(call: Call) -> str:
    return canonical_json({"name": call.name, "arguments": call.arguments})


def branch_key(kind: str, call: Call | None, text: str) -> str:
    """What a branch does, for folding duplicate candidates and comparing committed actions: the
    canonical call, or the kind and the text with whitespace runs folded (answers, parse errors)."""
    if kind == "call" and call is not None:
        return canonical_call(call)
    return f"{kind}:{' '.join(text.split())}"


def call_text(call: Call) -> str:
    """The call as the Act role writes it."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` - 3 characters and "..." when it is longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short_json(value: Any, limit: int = RESULT_CHARS) -> str:
    return cut(json.dumps(value, ensure_ascii=False, default=str), limit)


# ---------------------------------------------------------------- tools


def _type_of(schema: Any) -> str:
    if not isinstance(schema, dict):  # a boolean schema (`true`: anything), or one no reader checked
        return "any"
    t = schema.get("type", "any")
    if t == "array" and isinstance(schema.get("items"), dict):
        return f"list[{_type_of(schema['items'])}]"
    if isinstance(t, list):
        return "|".join(map(str, t))
    return {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
            "object": "dict", "array": "list"}.get(str(t), str(t))


def first_sentence(text: str) -> str:
    text = " ".join(text.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return match.group(1) if match else text


def tool_signature(tool: Tool, describe: bool = True) -> str:
    """`name(arg: type, opt?: type): first sentence of the description`."""
    props = tool.parameters.get("properties")
    props = props if isinstance(props, dict) else {}
    required = tool.parameters.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    args = ", ".join(f"{n}{'' if n in required else '?'}: {_type_of(s)}" for n, s in props.items())
    sig = f"{tool.name}({args})"
    return f"{sig}: {first_sentence(tool.description)}" if describe and tool.description else sig


def render_tools(tools: Iterable[Tool], count_tokens: CountTokens, budget: int = 1500) -> str:
    """One line per tool; drops descriptions (longest first) until the block fits `budget` tokens."""
    tools = list(tools)
    describe = {t.name: True for t in tools}

    def text() -> str:
        return "\n".join(tool_signature(t, describe[t.name]) for t in tools)

    rendered = text()
    by_length = sorted(tools, key=lambda t: -len(t.description))
    for tool in by_length:
        if count_tokens(rendered) <= budget:
            break
        describe[tool.name] = False
        rendered = text()
    return rendered


# ---------------------------------------------------------------- constraints

_ENUM_NOTE = re.compile(r"\[Enum\]:\s*(\[[^\]]*\])")
ERROR_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"error": {"type": "string"}},
                                "required": ["error"], "additionalProperties": False}


def grammar_schema(schema: dict[str, Any], closed: bool, max_string: int | None = None) -> dict[str, Any]:
    """A tool's JSON schema cut to what a grammar needs: types, properties (in order), required,
    items and enums (BFCL writes them in descriptions as `[Enum]: [...]`); text dropped.
    `closed`: objects allow no property beyond the listed ones and require the required ones (arguments; the
    validator rejects unknown ones), else extra keys stay allowed and none is required (response docs are
    incomplete, and a rehearsal near its token budget must be able to close its object: tau2's records list
    every field as required and were cut open).
    `max_string`: free-text strings get this `maxLength`, so a looping string closes in time."""
    out: dict[str, Any] = {}
    kind = schema.get("type")
    if kind is not None:
        out["type"] = kind
    enum = schema.get("enum")
    note = _ENUM_NOTE.search(str(schema.get("description", "")))
    if enum is None and note:
        try:
            enum = json.loads(note.group(1))
        except json.JSONDecodeError:
            enum = None
    if isinstance(schema.get("items"), dict):
        out["items"] = grammar_schema(schema["items"], closed, max_string)
    if isinstance(enum, list) and enum and all(isinstance(v, (str, int, float, bool)) for v in enum):
        if kind == "array" and "items" in out:
            out["items"].setdefault("enum", enum)  # "the list of doors ... [Enum]: [...]": the items' values
        else:
            out["enum"] = enum
    props = schema.get("properties")
    if isinstance(props, dict):
        out["properties"] = {name: grammar_schema(sub if isinstance(sub, dict) else {}, closed, max_string)
                             for name, sub in props.items()}
        required = [r for r in schema.get("required", []) or [] if r in props]
        if required and closed:  # a response may stop early: near the budget a Rehearse row closes its object
            out["required"] = required
    if kind == "object" and closed:
        out["additionalProperties"] = False
    if kind == "string" and max_string is not None and "enum" not in out:
        out["maxLength"] = max_string
    return out


ACT_MAX_STRING = 160
"""Characters allowed in one free-text argument of a constrained call. Greedy decoding of a
small model can loop inside a string until the token budget ends with the JSON unterminated;
capped, the string closes in time. 99.5% of the expert's string arguments are shorter
(the rest are file contents of 200 to 6,700 characters, over any Act budget anyway)."""


def call_schema(tool: Tool) -> dict[str, Any]:
    """`{"name": <this tool>, "arguments": <its parameters>}`, in the order `call_text` writes them."""
    args = grammar_schema(tool.parameters or {"type": "object"}, closed=True, max_string=ACT_MAX_STRING)
    args.setdefault("type", "object")
    args.setdefault("properties", {})
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": args},
            "required": ["name", "arguments"], "additionalProperties": False}


def in_schema_order(arguments: dict[str, Any], tool: Tool | None) -> dict[str, Any]:
    """`arguments` with the tool's documented parameters first, in their documented order: the
    order the constrained Act writes them in (JSON grammars fix key order), so training targets agree."""
    if tool is None:
        return dict(arguments)
    order = list((tool.parameters or {}).get("properties", {}) or {})
    known = {k: arguments[k] for k in order if k in arguments}
    return {**known, **{k: v for k, v in arguments.items() if k not in known}}


def act_constraint(tools: list[Tool], prefill: str = "") -> Constraint | None:
    """Exactly one schema-valid call of one of `tools`; without a `<tool_call>` prefill
    (tool_choice auto), a plain-text answer instead is allowed too."""
    if not tools:
        return None
    calls = [call_schema(t) for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    forced = prefill.endswith(TOOL_CALL_OPEN)
    return Constraint(schema=schema, open="" if forced else TOOL_CALL_OPEN, close=TOOL_CALL_CLOSE,
                      allow_text=not forced)


def rehearse_constraint(tool: Tool | None) -> Constraint:
    """The documented response, `{"error": string}`, or `null` (tools that return nothing);
    any JSON for a tool without a response schema."""
    if tool is None or not tool.response:
        schema: dict[str, Any] = {}
    else:
        schema = {"anyOf": [grammar_schema(tool.response, closed=False), ERROR_SCHEMA, {"type": "null"}]}
    return Constraint(schema=schema, close=RESULT_CLOSE, close_strings=True)


# ---------------------------------------------------------------- history


@dataclass
class HistoryItem:
    """One entry of the Act conversation."""

    role: Literal["user", "assistant", "tool"]
    content: str
    call: Call | None = None
    result: Any = None
    turn: int = 0


def history_messages(history: list[HistoryItem]) -> list[dict[str, str]]:
    out = []
    for item in history:
        if item.role == "tool":
            out.append({"role": "tool", "content": short_json(item.result)})
        else:
            out.append({"role": item.role, "content": item.content})
    return out


def fit_history(history: list[HistoryItem], fixed_tokens: int, count_tokens: CountTokens,
                context_window: int, reserve: int) -> list[HistoryItem]:
    """Drop the oldest call/result pairs (never user turns) until the prompt fits."""
    kept = list(history)
    budget = context_window - reserve - fixed_tokens

    def size(items: list[HistoryItem]) -> int:
        return sum(count_tokens(m["content"]) + 4 for m in history_messages(items))

    while size(kept) > budget:
        drop = next((i for i, h in enumerate(kept) if h.role != "user"), None)
        if drop is None:
            break
        kept.pop(drop)
    return kept


# ---------------------------------------------------------------- Act


def act_prompt(tools: list[Tool], history: list[HistoryItem], count_tokens: CountTokens,
               context_window: int, reserve: int = 256, tool_budget: int = 1500,
               memory: list[tuple[Call, Any]] | None = None, prefill: str = "",
               constrain: bool = False) -> Prompt:
    """The Act prompt: tools, the conversation so far, optionally a private rehearsal memory.
    `constrain` attaches `act_constraint` (the prompt text is the same either way)."""
    system = ACT_SYSTEM.format(tools=render_tools(tools, count_tokens, tool_budget))
    memory_text = ""
    if memory:
        lines = [f"- {call_text(c)} would return {short_json(r, 200)}" for c, r in memory]
        memory_text = ("Private rehearsal (not executed; predicted results):\n" + "\n".join(lines)
                       + "\nWrite the best next action.")
    fixed = count_tokens(system) + count_tokens(memory_text)
    kept = fit_history(history, fixed, count_tokens, context_window, reserve)
    messages = [{"role": "system", "content": system}, *history_messages(kept)]
    if memory_text:
        messages.append({"role": "user", "content": memory_text})
    return Prompt(messages=messages, prefill=prefill,
                  constraint=act_constraint(tools, prefill) if constrain else None)


# ---------------------------------------------------------------- Rehearse


def _trace_lines(history: list[HistoryItem], limit_chars: int = 200) -> list[str]:
    lines, pending = [], None
    for item in history:
        if item.role == "assistant" and item.call is not None:
            pending = item.call
        elif item.role == "tool" and pending is not None:
            lines.append(f"{call_text(pending)} -> {short_json(item.result, limit_chars)}")
            pending = None
    return lines


MEMORY_CHARS = 200
"""Each retrieved transition's response in a Rehearse prompt is cut to this many characters."""
MEMORY_HEADER = "Real results of similar calls (reuse a result when the call and the state match):"


def memory_lines(examples: Sequence[Any]) -> list[str]:
    """Retrieved transitions (`MemoryHit`s: `tool`, `arguments`, `response`, most similar first) as
    `call -> response` lines, most similar last: nearest the call it informs."""
    return [f"{call_text(Call(name=e.tool, arguments=e.arguments))} -> {short_json(e.response, MEMORY_CHARS)}"
            for e in reversed(examples)]


STATE_CHARS = 2000
"""The state's share of a Rehearse prompt: every BFCL `multi_turn_base` class's state fits (1,593 characters at
most, TradingBot's), a long-context file system is cut."""


def state_section(tool: Tool | None, state: Any) -> str:
    """The Rehearse prompt's state before the call: the tool's own class's (a BFCL state is keyed by class; the
    other classes cannot change this call's result), else the whole state; compact JSON, cut at `STATE_CHARS`."""
    if tool is not None and tool.env_class and isinstance(state, dict) and tool.env_class in state:
        head, state = f"Environment state ({tool.env_class}):", state[tool.env_class]
    else:
        head = "Environment state:"
    return head + "\n" + cut(canonical_json(state), STATE_CHARS)


def rehearse_prompt(tool: Tool | None, call: Call, history: list[HistoryItem],
                    state: dict[str, Any] | None = None, max_history: int = 10,
                    constrain: bool = False, examples: Sequence[Any] = ()) -> Prompt:
    """The Rehearse prompt: the episode's real calls and results, optionally the state (`state_section`), the
    tool, the real transitions retrieved for the call (`examples`, the rehearsal memory's hits), then the call.
    `constrain` attaches `rehearse_constraint` (the prompt text is the same either way)."""
    lines = _trace_lines(history)[-max_history:]
    shared = "Calls so far and their real results:\n" + ("\n".join(lines) if lines else "(none)")
    if state is not None:
        shared += "\n" + state_section(tool, state)
    if tool is None:
        spec = f"Tool: {call.name} (not a known tool)"
    else:
        spec = f"Tool: {tool_signature(tool)}\nParameters: {canonical_json(tool.parameters)}"
        if tool.response:
            spec += f"\nReturns: {canonical_json(tool.response)}"
    if examples:
        spec += "\n" + MEMORY_HEADER + "\n" + "\n".join(memory_lines(examples))
    question = f"{spec}\nCall: {call_text(call)}"
    return Prompt(
        messages=[{"role": "system", "content": REHEARSE_SYSTEM},
                  {"role": "user", "content": shared + "\n\n" + question}],
        prefill=RESULT_OPEN,
        constraint=rehearse_constraint(tool) if constrain else None,
    )


def rehearse_target(response: Any) -> str:
    """What the Rehearse role should write for a real response (after the prefill)."""
    return json.dumps(response, ensure_ascii=False, default=str) + RESULT_CLOSE


# ---------------------------------------------------------------- Judge


def judge_prompt(request: str, history: list[HistoryItem], action: str, predicted: Any) -> Prompt:
    lines = _trace_lines(history)[-6:]
    shared = f"User request: {request}\nDone so far:\n" + ("\n".join(lines) if lines else "(nothing)")
    branch = f"\nProposed: {action}\nExpected result: {short_json(predicted, 300)}\nMakes progress? Answer yes or no."
    return Prompt(messages=[{"role": "system", "content": JUDGE_SYSTEM},
                            {"role": "user", "content": shared + branch}])


# ---------------------------------------------------------------- parsing


@dataclass
class ParsedAction:
    kind: Literal["call", "answer", "parse_error"]
    call: Call | None = None
    answer: str | None = None
    error: str | None = None


def _first_json_value(text: str) -> Any:
    """Parse `text` as JSON, or else the first JSON object inside it."""
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        start = text.find("{")
        if start < 0:
            raise
        value, _ = json.JSONDecoder().raw_decode(text[start:])
        return value


def _call_from_json(obj: Any) -> Call:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError('a tool call must be an object with a "name" string')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError('"arguments" must be an object')
    return Call(name=obj["name"], arguments=args)


def parse_action(text: str) -> ParsedAction:
    """Act output -> a call, a plain-text answer, or a parse error (never raises)."""
    stripped = re.sub(r"<think>.*?</think>", "", text, flags=re.S).strip()
    if not stripped:
        return ParsedAction("parse_error", error="empty output")
    if TOOL_CALL_OPEN in stripped:
        body = stripped.split(TOOL_CALL_OPEN, 1)[1]
        closed = TOOL_CALL_CLOSE in body
        body = body.split(TOOL_CALL_CLOSE, 1)[0]
        try:
            return ParsedAction("call", call=_call_from_json(_first_json_value(body)))
        except (ValueError, json.JSONDecodeError) as exc:
            where = "" if closed else " (unclosed <tool_call>)"
            return ParsedAction("parse_error", error=f"invalid tool call{where}: {exc}")
    if stripped.startswith("{"):
        # Bare JSON with a name: a call without its tags; anything else JSON-like is malformed.
        try:
            return ParsedAction("call", call=_call_from_json(_first_json_value(stripped)))
        except (ValueError, json.JSONDecodeError) as exc:
            return ParsedAction("parse_error", error=f"invalid tool call: {exc}")
    if TOOL_CALL_CLOSE in stripped:
        return ParsedAction("parse_error", error="</tool_call> without <tool_call>")
    return ParsedAction("answer", answer=stripped)


def parse_result(text: str) -> tuple[Any, str | None]:
    """Rehearse output -> (predicted JSON value, None) or (None, parse error)."""
    body = re.sub(r"<think>.*?</think>", "", text, flags=re.S)
    if RESULT_OPEN in body:
        body = body.split(RESULT_OPEN, 1)[1]
    whole, body = body, body.split(RESULT_CLOSE, 1)[0].strip()
    if not body:
        return None, "empty <execution_result>"
    try:
        return _first_json_value(body), None
    except (ValueError, json.JSONDecodeError) as exc:
        if whole.count(RESULT_CLOSE) > 1:  # a string of the value quotes the close tag: the last one ends it
            try:
                return _first_json_value(whole[:whole.rindex(RESULT_CLOSE)]), None
            except (ValueError, json.JSONDecodeError):
                pass
        return None, f"invalid JSON in <execution_result>: {exc}"
