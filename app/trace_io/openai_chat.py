"""`--format openai`: JSONL of chat transcripts, one `{"messages": [...], "tools": [...]}` per line.

The shape of most tool-calling datasets and of TRL's conversational rows: an assistant message's `tool_calls`
(`{"id", "type": "function", "function": {"name", "arguments": "<JSON string>"}}`) answered by `tool` messages
naming the call's `tool_call_id`. Each line becomes one episode (`imported.TraceBuilder`); the whole file is
checked before anything is written, and the first problem is refused with its line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.records import Episode
from app.trace_io.imported import TraceBuilder, TraceFileError, content_key, json_lines, tool_from_definition

ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return json.dumps(content, ensure_ascii=False)


def _record(value: Any, where: str, file: str) -> Episode:
    if not isinstance(value, dict) or not isinstance(value.get("messages"), list):
        raise TraceFileError(f"{where}: not a chat transcript (expected an object with a \"messages\" list)")
    b = TraceBuilder(format="openai", file=file, trace_id=where, task_name=f"openai/{file or 'chat'}#{where.split()[-1]}")
    tools = value.get("tools") or []
    if isinstance(tools, str):  # TRL's advice for datasets: the tools as one JSON string
        try:
            tools = json.loads(tools)
        except ValueError:
            raise TraceFileError(f"{where}: \"tools\" is a string but not JSON") from None
    if not isinstance(tools, list):
        raise TraceFileError(f"{where}: \"tools\" is not a list")
    for i, t in enumerate(tools):
        tool = tool_from_definition(t)
        if tool is None:
            raise TraceFileError(f"{where}: tools[{i}] names no function")
        b.tool(tool)
    model = value.get("model")
    b.model = model if isinstance(model, str) and model else None
    for i, m in enumerate(value["messages"]):
        if not isinstance(m, dict):
            raise TraceFileError(f"{where}: messages[{i}] is not an object")
        role = m.get("role")
        if role not in ROLES:
            raise TraceFileError(f"{where}: messages[{i}] has role {role!r} (expected one of {', '.join(ROLES)})")
        text = _text(m.get("content"))
        if role in ("system", "developer"):
            b.system = f"{b.system}\n{text}" if b.system else text
        elif role == "user":
            b.user(text)
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise TraceFileError(f"{where}: messages[{i}].tool_calls is not a list")
            if not calls:
                b.answer(text)
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise TraceFileError(f"{where}: messages[{i}].tool_calls[{j}] names no function")
                call_id = c.get("id")
                if not isinstance(call_id, str) or not call_id:
                    raise TraceFileError(f"{where}: messages[{i}].tool_calls[{j}] has no id (a tool message "
                                         "could not answer it)")
                if call_id in b.pending:
                    raise TraceFileError(f"{where}: messages[{i}].tool_calls[{j}]: call id {call_id!r} repeats")
                b.call(fn["name"], fn.get("arguments", ""), call_id, text=text if j == 0 else "")
        else:  # tool
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in b.pending:
                raise TraceFileError(f"{where}: messages[{i}] answers call id {call_id!r}, which no assistant "
                                     "message before it made")
            if call_id in b.answered:
                raise TraceFileError(f"{where}: messages[{i}] answers call id {call_id!r} a second time")
            b.answered.add(call_id)
            b.result(b.pending[call_id], m.get("content") if isinstance(m.get("content"), str) else _text(m.get("content")))
    return b.episode(content_key(value))


def parse_openai(data: bytes, file: str = "") -> list[Episode]:
    """Every transcript of a chat JSONL file as an Episode; TraceFileError names the first bad line."""
    episodes: list[Episode] = []
    for line_no, value in json_lines(data):
        episodes.append(_record(value, f"line {line_no}", Path(file).name))
    return episodes


__all__ = ["parse_openai"]
