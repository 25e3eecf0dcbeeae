"""What every foreign trace format shares: one builder that turns a recorded conversation into an Episode.

A format's reader (`openai_chat`, `otlp`) walks its file and tells the builder what happened, in order: the
system prompt, user messages, the tools declared, each call with its recorded result, the agent's answers. The
builder makes the internal form the engine writes (`app.records`): one step per committed action, one branch
per step (the recorded call, chosen, its real response as `actual`), nothing predicted. What the file did not
record is stated in `TraceSource.missing`, never filled in.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from app.formats import call_text, canonical_json
from app.records import (TRACE_PREFIX, Branch, Call, Episode, RunSettings, Step, TraceFormat, TraceSource, TraceTool,
                         utcnow)

NO_RECORDED_RESPONSE = "no recorded response: the trace holds no result for this call"
"""`Branch.not_executed` of a recorded call whose result the file did not record."""
UNKNOWN_MODEL = "unknown"
"""`Episode.model` when the file does not name the agent's model."""
IMPORT_SETTINGS = RunSettings(mode="none", branches=1, shadow=False, constrain=False)
"""What an imported episode "ran" with: one recorded action per step, nothing rehearsed, nothing forked."""


class TraceFileError(ValueError):
    """A trace file that cannot be imported; the message names the line (or span) and the problem."""


def size_text(n: int) -> str:
    """A byte count as people read it (`3.2 MiB`)."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def read_bounded(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """A trace file's bytes, refusing a missing or oversized file before reading it."""
    p = Path(path)
    if not p.is_file():
        raise TraceFileError("no such file")
    size = p.stat().st_size
    if size > max_bytes:
        raise TraceFileError(f"the file is {size_text(size)}; the limit is {size_text(max_bytes)}")
    return p.read_bytes()


def json_error(where: str, exc: json.JSONDecodeError) -> TraceFileError:
    return TraceFileError(f"{where}: not JSON at column {exc.colno} ({exc.msg.removesuffix(' at').lower()})")


def json_lines(data: bytes, max_line: int | None = None, unit: str = "line") -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSONL file; TraceFileError names the first line that is
    over `max_line` bytes, not UTF-8 or not JSON."""
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if max_line is not None and len(raw) > max_line:
            raise TraceFileError(f"line {line_no}: {size_text(len(raw))} is over the {size_text(max_line)} limit "
                                 f"of one {unit}")
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except UnicodeDecodeError:
            raise TraceFileError(f"line {line_no}: not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise json_error(f"line {line_no}", exc) from None
        yield line_no, value


def response_value(value: Any) -> Any:
    """A recorded tool result as JSON: a string that holds JSON is read as that JSON; any other string stays text."""
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in ("{", "[", '"') or text in ("true", "false", "null") or _number(text):
            try:
                return json.loads(text)
            except ValueError:
                return value
    return value


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def is_error_response(value: Any) -> bool:
    """The project's own convention for a failed call's response (`{"error": ...}`, `app.envs.base`)."""
    return isinstance(value, dict) and "error" in value


def tool_from_definition(value: Any) -> TraceTool | None:
    """A tool from an OpenAI-style definition (`{"type": "function", "function": {...}}`, or the function object
    itself, as OTel's `gen_ai.tool.definitions` writes it); None when it names no tool."""
    if not isinstance(value, dict):
        return None
    fn = value.get("function") if isinstance(value.get("function"), dict) else value
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        return None
    params = fn.get("parameters", fn.get("input_schema"))
    return TraceTool(name=name, description=str(fn.get("description") or ""),
                     parameters=params if isinstance(params, dict) else None)


@dataclass
class RecordedStep:
    turn: int
    branch: Branch
    created_at: str


@dataclass
class TraceBuilder:
    """Collects one recorded conversation; `episode()` makes it an Episode."""

    format: TraceFormat
    file: str
    trace_id: str
    created_at: str = field(default_factory=utcnow)
    model: str | None = None
    system: str = ""
    turns: list[list[dict[str, str]]] = field(default_factory=list)
    tools: dict[str, TraceTool] = field(default_factory=dict)
    steps: list[RecordedStep] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    pending: dict[str, Branch] = field(default_factory=dict)
    """Calls by call id, awaiting their result."""
    answered: set[str] = field(default_factory=set)
    episode_id: str | None = None
    task_name: str | None = None
    end_reason: str | None = None

    @property
    def turn(self) -> int:
        return max(len(self.turns) - 1, 0)

    def user(self, text: str) -> None:
        """A user message: a new turn once the agent acted in the open one."""
        if not self.turns or any(s.turn == len(self.turns) - 1 for s in self.steps):
            self.turns.append([])
        self.turns[-1].append({"role": "user", "content": text})

    def tool(self, tool: TraceTool) -> None:
        """A declared tool (the first declaration of a name wins). A property whose schema is `null` (what a
        datasets/Arrow export writes for another tool's property) is not a schema: left out, and said."""
        if tool.name in self.tools:
            return
        props = (tool.parameters or {}).get("properties")
        if isinstance(props, dict) and any(v is None for v in props.values()):
            dropped = sorted(k for k, v in props.items() if v is None)
            tool = tool.model_copy(update={"parameters": {**tool.parameters, "properties": {
                k: v for k, v in props.items() if v is not None}}})
            self.note(f"tool {tool.name}: the schema of {', '.join(dropped)} is null (not a schema), left out")
        self.tools[tool.name] = tool

    def call(self, name: str, arguments: Any, call_id: str | None = None, *, text: str = "",
             created_at: str | None = None, turn: int | None = None) -> Branch:
        """A recorded call; `arguments` a JSON string (as chat APIs write them) or an object. Arguments that are
        not a JSON object are recorded as the agent's parse error, as the engine records one."""
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        parsed: Any = arguments
        problem = None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                problem = f"the arguments of {name} are not JSON ({exc})"
        if problem is None and not isinstance(parsed, dict):
            problem = f"the arguments of {name} are not a JSON object"
        if problem is None:
            call = Call(name=name, arguments=parsed)
            said = call_text(call)
            branch = Branch(index=0, action_text=f"{text.strip()}\n{said}" if text.strip() else said, kind="call",
                            call=call, chosen=True)
        else:
            branch = Branch(index=0, action_text=f"{text.strip()}\n{raw}" if text.strip() else raw,
                            kind="parse_error", parse_error=problem, chosen=True)
        self.steps.append(RecordedStep(self.turn if turn is None else turn, branch, created_at or self.created_at))
        if call_id:
            self.pending[call_id] = branch
        return branch

    def result(self, branch: Branch, value: Any, error: bool | None = None) -> None:
        """The recorded result of a call (`error` None: by the `{"error": ...}` convention)."""
        value = response_value(value)
        branch.actual, branch.actual_source = value, "committed"
        branch.actual_error = is_error_response(value) if error is None else error
        branch.not_executed = None

    def answer(self, text: str, *, created_at: str | None = None, turn: int | None = None) -> None:
        branch = Branch(index=0, action_text=text, kind="answer", chosen=True)
        self.steps.append(RecordedStep(self.turn if turn is None else turn, branch, created_at or self.created_at))

    def note(self, text: str) -> None:
        if text not in self.missing:
            self.missing.append(text)

    def episode(self, content_key: str) -> Episode:
        """The Episode: its id from the format and `content_key` (the same trace imports as the same episode)."""
        steps: list[Step] = []
        for i, s in enumerate(self.steps):
            b = s.branch
            if b.kind in ("call", "parse_error") and b.actual_source is None and b.not_executed is None:
                b.not_executed = NO_RECORDED_RESPONSE
                what = b.call.name if b.call else "an unparsed call"
                self.note(f"step {i}: no result recorded for {what}")
            steps.append(Step(index=i, turn=s.turn, branches=[b], chosen=0, kind=b.kind,
                              external_calls=int(b.actual_source is not None), created_at=s.created_at))
        for s in steps:  # tools only called, never declared
            call = s.chosen_branch.call
            if call is not None and call.name not in self.tools:
                self.tools[call.name] = TraceTool(name=call.name)
        for tool in self.tools.values():
            if tool.parameters is None:
                self.note(f"no schema recorded for tool {tool.name}")
        if not self.tools:
            self.note("the trace declares no tools")
        if self.model is None:
            self.note("the agent's model is not recorded")
        if not any(self.turns):
            self.note("no user message recorded")
        digest = hashlib.sha256(f"{self.format}\n{content_key}".encode()).hexdigest()
        name = self.task_name or f"{self.format}/{self.trace_id}"
        last = steps[-1].kind if steps else None
        return Episode(
            id=self.episode_id or f"trace-{digest[:12]}", task_id=f"{TRACE_PREFIX}{name}",
            model=self.model or UNKNOWN_MODEL, settings=IMPORT_SETTINGS, status="finished",
            external_calls=sum(s.external_calls for s in steps), steps=steps, created_at=self.created_at,
            finished_at=steps[-1].created_at if steps else self.created_at,
            end_reason=self.end_reason or ("answered" if last == "answer" else None),  # type: ignore[arg-type]
            trace=TraceSource(format=self.format, file=self.file, trace_id=self.trace_id, system=self.system,
                              turns=self.turns, tools=list(self.tools.values()), missing=self.missing))


def content_key(value: Any) -> str:
    return canonical_json(value)


__all__ = ["IMPORT_SETTINGS", "NO_RECORDED_RESPONSE", "TraceBuilder", "TraceFileError", "UNKNOWN_MODEL",
           "content_key", "is_error_response", "response_value", "tool_from_definition"]
