"""Training rows -> TRL conversational JSONL, for training at scale with `trl sft` and `accelerate launch`.

The rows are the light fine-tune's own (`app.training.rows`: the same prompts, built by the
engine's prompt functions, and the same targets). Each becomes one JSON line:

- `messages`: the prompt's chat messages, then the assistant's reply (the target, after any
  prefill). In `structured` form an assistant tool call is `tool_calls` (OpenAI shape:
  `arguments` a JSON string, which chat templates such as Qwen3's print as is) and a tool
  result is a `tool` message naming its tool; in `text` form every message is exactly the
  text the engine renders (`<tool_call>...</tool_call>`).
  With `prompt-completion` shape the same messages are split into `prompt` (all but the
  reply) and `completion` (the reply), so TRL puts the loss on the reply only, as the light
  fine-tune does.
- `tools` (Act rows, `structured` form): the JSON-schema functions available at that step.
- `rehearsal`: `predicted` (what the model's Rehearse role wrote for that branch, when it
  ran), `branch` (the branch index), `chosen` (whether it was committed), `actual` (the real
  response), for filtering and analysis; TRL ignores unknown columns.

Free-form JSON values (call arguments, predicted and actual responses) are written as JSON
text: Arrow, under `datasets`, needs one type per column, and a tool argument that is a string
in one row and a number in the next would not load.
- `role` (`act` / `rehearse`), `source` (`correction`, `self`, `expert`) and `ref` (episode/step/branch).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from app.envs.base import Tool
from app.formats import parse_action
from app.records import Branch, Episode
from model_backend.training import TrainRow

ToolFormat = Literal["structured", "text"]
Shape = Literal["messages", "prompt-completion"]

_MESSAGE: dict[str, Any] = {
    "type": "object", "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "user", "assistant", "tool"]},
        "content": {"type": "string"},
        "name": {"type": "string"},
        "tool_calls": {"type": "array", "items": {
            "type": "object", "required": ["type", "function"],
            "properties": {"type": {"const": "function"}, "function": {
                "type": "object", "required": ["name", "arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
    },
}
ROW_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "required": ["role", "source", "ref", "rehearsal"],
    "anyOf": [{"required": ["messages"]}, {"required": ["prompt", "completion"]}],
    "properties": {
        "messages": {"type": "array", "minItems": 2, "items": _MESSAGE},
        "prompt": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "completion": {"type": "array", "minItems": 1, "maxItems": 1, "items": _MESSAGE},
        "tools": {"type": "array", "items": {
            "type": "object", "required": ["type", "function"],
            "properties": {"type": {"const": "function"}, "function": {
                "type": "object", "required": ["name", "parameters"],
                "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                               "parameters": {"type": "object"}}}}}},
        "role": {"enum": ["act", "rehearse"]},
        "source": {"type": "string"},
        "ref": {"type": "string"},
        "rehearsal": {
            "type": "object", "required": ["predicted", "branch", "chosen"],
            "properties": {"predicted": {"type": ["string", "null"]}, "actual": {"type": ["string", "null"]},
                           "branch": {"type": ["integer", "null"]}, "chosen": {"type": ["boolean", "null"]}},
        },
    },
}
"""One exported line (also what a reader can validate against)."""


@dataclass
class ExportStats:
    rows: int
    act: int
    rehearse: int
    path: Path


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def tool_schema(tool: Tool) -> dict[str, Any]:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


def _structured(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `<tool_call>` text -> `tool_calls`; the tool message that follows names the tool."""
    out: list[dict[str, Any]] = []
    pending: str | None = None
    for m in messages:
        m = dict(m)
        if m["role"] == "assistant":
            parsed = parse_action(m["content"])
            pending = None
            if parsed.kind == "call" and parsed.call is not None:
                m = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": parsed.call.name, "arguments": _json(parsed.call.arguments)}}]}
                pending = parsed.call.name
        elif m["role"] == "tool" and pending:
            m["name"] = pending
            pending = None
        out.append(m)
    return out


def _branch_index(episodes: dict[str, Episode]) -> dict[str, Branch]:
    """`episode/step/branch` -> the stored branch."""
    return {f"{ep.id}/{s.index}/{b.index}": b for ep in episodes.values() for s in ep.steps for b in s.branches}


def row_record(row: TrainRow, branches: dict[str, Branch], tools: list[Tool] | None,
               tool_format: ToolFormat = "structured", shape: Shape = "messages") -> dict[str, Any]:
    """One TrainRow as a TRL conversational record with the rehearsal fields."""
    reply = row.prompt.prefill + row.target
    messages = [*row.prompt.messages, {"role": "assistant", "content": reply}]
    record: dict[str, Any] = {}
    if tool_format == "structured" and row.role == "act":
        messages = _structured(messages)
        record["tools"] = [tool_schema(t) for t in tools or []]
    branch = branches.get(row.ref.split("#", 1)[0])
    if shape == "prompt-completion":  # TRL then computes the loss on the completion only, as the fine-tune does
        record.update({"prompt": messages[:-1], "completion": messages[-1:]})
    else:
        record["messages"] = messages
    record.update({
        "role": row.role, "source": row.source, "ref": row.ref,
        "rehearsal": {"predicted": branch.predicted_text if branch else None,
                      "branch": branch.index if branch else None,
                      "chosen": branch.chosen if branch else None,
                      "actual": _json(branch.actual) if branch and branch.actual_source else None},
    })
    return record


def step_tools(episodes: dict[str, Episode]) -> dict[str, list[Tool]]:
    """`episode/step` -> the tools the agent had at that step (the same replay that built the prompts)."""
    from app.service.catalog import episode_task, task_env
    from app.engine.replay import replay

    out: dict[str, list[Tool]] = {}
    for ep in episodes.values():
        try:
            task = episode_task(ep)  # typed instructions too, with the turns a person typed
            env = task_env(task)
        except ValueError:
            continue
        for view in replay(ep, task, env):
            out[f"{ep.id}/{view.step.index}"] = view.tools
    return out


def write_jsonl(rows: Iterable[TrainRow], episodes: dict[str, Episode], out: Path,
                tool_format: ToolFormat = "structured", shape: Shape = "messages") -> ExportStats:
    """Write the records to `out` through a temp file and one rename (a failed export leaves nothing)."""
    rows = list(rows)
    branches = _branch_index(episodes)
    tools = step_tools(episodes) if tool_format == "structured" else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            step_ref = "/".join(row.ref.split("#", 1)[0].split("/")[:2])
            record = row_record(row, branches, tools.get(step_ref), tool_format, shape)
            fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    tmp.replace(out)
    act = sum(r.role == "act" for r in rows)
    return ExportStats(len(rows), act, len(rows) - act, out)


__all__ = ["ExportStats", "ROW_SCHEMA", "row_record", "step_tools", "tool_schema", "write_jsonl"]
