"""`--format otlp`: OTLP/JSON span files in, OTLP/JSON out.

Reading: a file holds one `ExportTraceServiceRequest` as JSON, or one per line (what OpenTelemetry's OTLP JSON file
exporter and the Collector's file exporter write). Each line is parsed by the OpenTelemetry proto package
(`json_format.ParseDict` into `ExportTraceServiceRequest`, after the OTLP/JSON hex ids are turned into the base64
the proto JSON mapping expects), so a misspelt field or a wrong type is refused with its line. Each trace id
becomes one episode:

- steps are its tool spans, by start time: OpenTelemetry GenAI (`gen_ai.operation.name` `execute_tool` or a
  `gen_ai.tool.name`: `gen_ai.tool.call.arguments`, `gen_ai.tool.call.result`) and OpenInference
  (`openinference.span.kind` `TOOL`: `tool.name`, `input.value`, `output.value`); a failed span (status ERROR)
  without a result answers `{"error": <its status message>}`;
- the agent's plain answers are model spans (GenAI `chat`, OpenInference `LLM`) whose output has text and no
  tool call;
- user turns, the system prompt, the model and the tools come from the model spans' inputs
  (`gen_ai.input.messages`, `gen_ai.system_instructions`, `gen_ai.tool.definitions`, `gen_ai.request.model`;
  `llm.input_messages.N.message.*`, `llm.tools.N.tool.json_schema`, `llm.model_name`), or, without any, from an
  OpenInference AGENT span's `input.value`.

Writing (`export_otlp`): one trace per episode, an `invoke_agent` root span and one child per step (`execute_tool`
for a call, `chat` for an answer) with the GenAI attributes, the rehearsal as `rehearsal.*` attributes of the
tool span, and `envace.*` attributes that let `parse_otlp` rebuild the very same episode.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from app.formats import canonical_json
from app.records import Episode, Metrics, TraceTool
from app.trace_io.imported import (TraceBuilder, TraceFileError, content_key, json_error, response_value,
                                   tool_from_definition)

UNPARSED_CALL = "(unparsed call)"
"""`gen_ai.tool.name` of an exported step whose call did not parse (its text is in `envace.step.action_text`)."""
SPAN_KIND_INTERNAL = 1
STATUS_ERROR = 2
REHEARSAL_ATTRIBUTES = ("json_valid", "exact", "field_f1", "error_agree", "surprise")
"""`rehearsal.<metric>` on an exported tool span (with `rehearsal.predicted` and `rehearsal.predicted_text`)."""


# ---------------------------------------------------------------- reading


def _ids_to_base64(value: Any) -> Any:
    """OTLP/JSON writes trace and span ids as hex; the proto JSON mapping of `bytes` wants base64."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in ("traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id") and isinstance(v, str):
                try:
                    out[k] = base64.b64encode(bytes.fromhex(v)).decode()
                except ValueError:
                    raise TraceFileError(f"{k} {v[:40]!r} is not hex") from None
            else:
                out[k] = _ids_to_base64(v)
        return out
    if isinstance(value, list):
        return [_ids_to_base64(v) for v in value]
    return value


def _any_value(v: Any) -> Any:
    """A proto AnyValue as Python."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_any_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _any_value(kv.value) for kv in v.kvlist_value.values}
    if kind == "bytes_value":
        return base64.b64encode(v.bytes_value).decode()
    return getattr(v, kind)


@dataclass
class SpanView:
    """One span, flattened: what the import reads of it."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attrs: dict[str, Any]
    error: bool
    status_message: str
    where: str
    """`line N, span <id>` (for messages)."""

    def text(self, key: str) -> str | None:
        v = self.attrs.get(key)
        return v if isinstance(v, str) else None

    def json(self, key: str) -> Any:
        v = self.attrs.get(key)
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError:
                raise TraceFileError(f"{self.where}: {key} is not JSON") from None
        return v


def _parse_lines(data: bytes) -> list[SpanView]:
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceFileError("not UTF-8 text") from None
    stripped = text.strip()
    chunks: list[tuple[int, str]]
    if stripped.startswith("{") and "\n" in stripped:
        try:
            json.loads(stripped)
            chunks = [(1, stripped)]  # one pretty-printed request
        except ValueError:
            chunks = [(i, line) for i, line in enumerate(text.split("\n"), start=1) if line.strip()]
    else:
        chunks = [(i, line) for i, line in enumerate(text.split("\n"), start=1) if line.strip()]
    spans: list[SpanView] = []
    for line_no, chunk in chunks:
        try:
            value = json.loads(chunk)
        except json.JSONDecodeError as exc:
            raise json_error(f"line {line_no}", exc) from None
        if not isinstance(value, dict) or not any(k in value for k in ("resourceSpans", "resource_spans")):
            raise TraceFileError(f"line {line_no}: not an OTLP trace export (expected an object with \"resourceSpans\")")
        try:
            request = json_format.ParseDict(_ids_to_base64(value), ExportTraceServiceRequest())
        except TraceFileError as exc:
            raise TraceFileError(f"line {line_no}: {exc}") from None
        except json_format.ParseError as exc:
            raise TraceFileError(f"line {line_no}: not OTLP/JSON ({str(exc).splitlines()[0][:200]})") from None
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                for s in ss.spans:
                    span_id = s.span_id.hex()
                    where = f"line {line_no}, span {span_id or '(no id)'}"
                    if len(s.trace_id) != 16:
                        raise TraceFileError(f"{where}: traceId must be 16 bytes (32 hex digits)")
                    attrs = {kv.key: _any_value(kv.value) for kv in s.attributes}
                    spans.append(SpanView(s.trace_id.hex(), span_id, s.parent_span_id.hex(), s.name,
                                          int(s.start_time_unix_nano), int(s.end_time_unix_nano), attrs,
                                          s.status.code == STATUS_ERROR, s.status.message, where))
    if not spans:
        raise TraceFileError("the file holds no spans")
    return spans


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="seconds")


def _is_tool_span(s: SpanView) -> bool:
    return (s.attrs.get("openinference.span.kind") == "TOOL" or s.attrs.get("gen_ai.operation.name") == "execute_tool"
            or "gen_ai.tool.name" in s.attrs)


def _is_model_span(s: SpanView) -> bool:
    return (s.attrs.get("openinference.span.kind") == "LLM"
            or s.attrs.get("gen_ai.operation.name") in ("chat", "text_completion", "generate_content"))


def _oi_messages(attrs: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """OpenInference's flattened `llm.input_messages.N.message.*` as `{"role", "text", "tool_calls"}` dicts."""
    found: dict[int, dict[str, Any]] = {}
    head = f"{prefix}."
    for key, value in attrs.items():
        if not key.startswith(head):
            continue
        index, _, rest = key[len(head):].partition(".")
        if not index.isdigit():
            continue
        m = found.setdefault(int(index), {"role": "", "parts": {}, "text": "", "tool_calls": {}})
        if rest == "message.role":
            m["role"] = value
        elif rest == "message.content":
            m["text"] = value
        elif rest.startswith("message.contents.") and rest.endswith(".message_content.text"):
            m["parts"][int(rest.split(".")[2])] = value
        elif rest.startswith("message.tool_calls."):
            j = int(rest.split(".")[2])
            m["tool_calls"].setdefault(j, {})[rest.split(".", 3)[3]] = value  # e.g. tool_call.function.name
    out = []
    for i in sorted(found):
        m = found[i]
        text = m["text"] or "".join(str(m["parts"][j]) for j in sorted(m["parts"]))
        calls = [{"id": c.get("tool_call.id"), "name": c.get("tool_call.function.name"),
                  "arguments": c.get("tool_call.function.arguments", "")} for j, c in sorted(m["tool_calls"].items())]
        out.append({"role": _role(m["role"]), "text": text, "tool_calls": calls})
    return out


def _role(role: Any) -> str:
    """A message's role, `MessageRole.USER` (a framework's enum written as text) read as `user`."""
    return str(role or "").rsplit(".", 1)[-1].lower()


def _genai_messages(value: Any) -> list[dict[str, Any]]:
    """GenAI `gen_ai.input.messages`/`gen_ai.output.messages` (role and parts) as `{"role", "text", "tool_calls"}`."""
    out = []
    for m in value if isinstance(value, list) else []:
        if not isinstance(m, dict):
            continue
        parts = m.get("parts")
        if isinstance(parts, list):
            text = "".join(str(p.get("content", "")) for p in parts if isinstance(p, dict) and p.get("type") == "text")
            calls = [p for p in parts if isinstance(p, dict) and p.get("type") == "tool_call"]
        else:
            text = m.get("content") if isinstance(m.get("content"), str) else ""
            calls = m.get("tool_calls") or []
        out.append({"role": _role(m.get("role")), "text": text, "tool_calls": calls})
    return out


def _tool_arguments(s: SpanView) -> Any:
    if "gen_ai.tool.call.arguments" in s.attrs:
        return s.attrs["gen_ai.tool.call.arguments"]
    if "tool_call.function.arguments" in s.attrs:
        return s.attrs["tool_call.function.arguments"]
    raw = s.attrs.get("input.value")
    if raw is None:
        return None
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw
    # smolagents' instrumentation writes the Python call: {"args": [], "kwargs": {...}, ...}
    if isinstance(value, dict) and isinstance(value.get("kwargs"), dict) and not value.get("args"):
        return value["kwargs"]
    return value


def _tool_result(s: SpanView) -> tuple[bool, Any]:
    for key in ("gen_ai.tool.call.result", "output.value"):
        if key in s.attrs:
            return True, s.attrs[key]
    if s.error and s.status_message:
        return True, {"error": s.status_message}
    return False, None


def _tools_of(s: SpanView, b: TraceBuilder) -> None:
    defs = s.json("gen_ai.tool.definitions")
    for d in defs if isinstance(defs, list) else []:
        tool = tool_from_definition(d)
        if tool is not None:
            b.tool(tool)
    i = 0
    while f"llm.tools.{i}.tool.json_schema" in s.attrs:
        tool = tool_from_definition(s.json(f"llm.tools.{i}.tool.json_schema"))
        if tool is not None:
            b.tool(tool)
        i += 1


def _episode(trace_id: str, spans: list[SpanView], file: str) -> Episode:
    spans.sort(key=lambda s: (s.start_ns, s.end_ns))
    root = next((s for s in spans if "envace.episode.id" in s.attrs), None)
    b = TraceBuilder(format="otlp", file=file, trace_id=trace_id, created_at=_iso(spans[0].start_ns))
    seen_users = 0
    decided: list[tuple[str | None, str, Any]] = []
    """Calls a model span's output made, awaiting the tool span that ran them: (call id, tool name, branch)."""
    for s in spans:
        _tools_of(s, b)
    for s in spans:
        if s is root:
            continue
        turn = s.attrs.get("envace.step.turn") if root is not None else None
        created = s.text("envace.step.created_at") or _iso(s.start_ns)
        if _is_tool_span(s):
            name = s.text("gen_ai.tool.name") or s.text("tool.name")
            if not name:
                raise TraceFileError(f"{s.where}: a tool span without a tool name (gen_ai.tool.name or tool.name)")
            if name not in b.tools and s.text("tool.parameters"):
                params = s.json("tool.parameters")
                if isinstance(params, dict) and "properties" not in params and "type" not in params:
                    params = {"type": "object", "properties": params}  # OpenInference writes the properties only
                b.tool(TraceTool(name=name, description=s.text("tool.description") or "",
                                 parameters=params if isinstance(params, dict) else None))
            call_id = s.text("gen_ai.tool.call.id") or s.text("tool_call.id")
            match = next((d for d in decided if call_id and d[0] == call_id), None) or \
                next((d for d in decided if d[1] == name and not (call_id and d[0])), None)
            if match is not None:  # the call a model span decided: this span is its execution
                decided.remove(match)
                branch = match[2]
            else:
                arguments = _tool_arguments(s)
                if arguments is None:
                    arguments = ""
                    b.note(f"{s.where}: the arguments of {name} are not recorded")
                branch = b.call(name, arguments, created_at=created, turn=turn)
            if root is not None:  # our own export: the step exactly as it was recorded
                branch.action_text = s.text("envace.step.action_text") or branch.action_text
                branch.parse_error = s.text("envace.step.parse_error") or branch.parse_error
            has, result = _tool_result(s)
            if has:
                b.result(branch, result, error=s.error)
            if "rehearsal.predicted" in s.attrs or "rehearsal.predicted_text" in s.attrs:
                _rehearsal_in(branch, s)
            continue
        if not _is_model_span(s):
            continue
        if s.text("gen_ai.request.model") or s.text("llm.model_name") or s.text("gen_ai.response.model"):
            b.model = b.model or s.text("gen_ai.request.model") or s.text("llm.model_name") or s.text("gen_ai.response.model")
        inputs = (_genai_messages(s.json("gen_ai.input.messages")) if "gen_ai.input.messages" in s.attrs
                  else _oi_messages(s.attrs, "llm.input_messages"))
        instructions = s.json("gen_ai.system_instructions")
        if not b.system and isinstance(instructions, list):
            b.system = "".join(str(p.get("content", "")) for p in instructions if isinstance(p, dict))
        users = [m["text"] for m in inputs if m["role"] == "user"]
        if any(not u for u in users):
            b.note("the content of some user messages is not recorded")
            users = [u for u in users if u]
        if not b.system:
            b.system = next((m["text"] for m in inputs if m["role"] == "system"), "")
        if root is None:
            for text in users[seen_users:]:
                b.user(text)
            seen_users = max(seen_users, len(users))
        outputs = (_genai_messages(s.json("gen_ai.output.messages")) if "gen_ai.output.messages" in s.attrs
                   else _oi_messages(s.attrs, "llm.output_messages"))
        for m in outputs:
            if m["role"] in ("assistant", "") and m["text"] and not m["tool_calls"]:
                b.answer(m["text"], created_at=created, turn=turn)
            for tc in m["tool_calls"]:
                name = tc.get("name") if isinstance(tc, dict) else None
                if not isinstance(name, str) or not name:
                    raise TraceFileError(f"{s.where}: a tool call in the model's output names no tool")
                call_id = tc.get("id") if isinstance(tc.get("id"), str) else None
                decided.append((call_id, name, b.call(name, tc.get("arguments", ""), created_at=created, turn=turn)))
    if root is not None:
        _identity_in(b, root)
    elif not any(b.turns):
        agent = next((s for s in spans if s.attrs.get("openinference.span.kind") == "AGENT"), None)
        said = agent.json("input.value") if agent is not None and isinstance(agent.attrs.get("input.value"), str) else None
        task = said.get("task") if isinstance(said, dict) else None  # smolagents' run(task=...)
        if isinstance(task, str) and task:
            b.user(task)
            for rs in b.steps:
                rs.turn = 0
    if not b.steps:
        raise TraceFileError(f"trace {trace_id}: no tool span and no answer: nothing to import")
    key = content_key([[s.name, s.attrs, s.error, s.status_message] for s in spans])
    return b.episode(key)


def _identity_in(b: TraceBuilder, root: SpanView) -> None:
    """An exported episode's own identity back from its root span's `envace.*` attributes."""
    b.episode_id = root.text("envace.episode.id")
    task = root.text("envace.task_id") or ""
    b.task_name = task.partition(":")[2] or None
    b.created_at = root.text("envace.created_at") or b.created_at
    b.model = root.text("gen_ai.request.model") or b.model
    b.format = root.text("envace.trace.format") or b.format  # type: ignore[assignment]
    b.file = root.text("envace.trace.file") or ""
    b.trace_id = root.text("envace.trace.id") or b.trace_id
    b.end_reason = root.text("envace.end_reason")
    turns = root.json("envace.trace.turns")
    b.turns = turns if isinstance(turns, list) else []
    b.system = root.text("envace.trace.system") or ""
    missing = root.json("envace.trace.missing")
    b.missing = [m for m in missing if isinstance(m, str)] if isinstance(missing, list) else []
    tools = root.json("envace.trace.tools")
    if isinstance(tools, list):
        b.tools = {t["name"]: TraceTool.model_validate(t) for t in tools if isinstance(t, dict) and "name" in t}


def _rehearsal_in(branch: Any, s: SpanView) -> None:
    if "rehearsal.predicted" in s.attrs:
        branch.predicted = s.json("rehearsal.predicted")
    branch.predicted_text = s.text("rehearsal.predicted_text")
    branch.metrics = Metrics(**{m: s.attrs.get(f"rehearsal.{m}") for m in REHEARSAL_ATTRIBUTES})


def parse_otlp(data: bytes, file: str = "") -> list[Episode]:
    """Every trace of an OTLP/JSON file as an Episode; TraceFileError names the first bad line or span."""
    by_trace: dict[str, list[SpanView]] = {}
    for s in _parse_lines(data):
        by_trace.setdefault(s.trace_id, []).append(s)
    return [_episode(trace_id, spans, Path(file).name) for trace_id, spans in by_trace.items()]


# ---------------------------------------------------------------- writing


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}


def _attributes(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in values.items() if v is not None]


def _ns(iso: str) -> int:
    try:
        return int(datetime.fromisoformat(iso).timestamp() * 1e9)
    except ValueError:
        return 0


def _hex(*parts: Any, n: int) -> str:
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()[:n]


def episode_spans(ep: Episode) -> dict[str, Any]:
    """One episode as an OTLP/JSON `ExportTraceServiceRequest` (a dict): an `invoke_agent` root span and one child
    span per step."""
    src = ep.trace
    trace_id = src.trace_id if src is not None and len(src.trace_id) == 32 and _is_hex(src.trace_id) else \
        _hex("trace", ep.id, n=32)
    root_id = _hex("root", ep.id, n=16)
    start = _ns(ep.created_at)
    turns = src.turns if src is not None else []
    tools = src.tools if src is not None else []
    users = [{"role": "user", "parts": [{"type": "text", "content": m["content"]}]} for t in turns for m in t]
    spans = [{
        "traceId": trace_id, "spanId": root_id, "name": f"invoke_agent {ep.task_id}", "kind": SPAN_KIND_INTERNAL,
        "startTimeUnixNano": str(start), "endTimeUnixNano": str(_ns(ep.finished_at or ep.created_at)),
        "attributes": _attributes({
            "gen_ai.operation.name": "invoke_agent", "gen_ai.request.model": ep.model,
            "gen_ai.input.messages": users,
            "gen_ai.system_instructions": [{"type": "text", "content": src.system}] if src and src.system else None,
            "gen_ai.tool.definitions": [{"type": "function", "name": t.name, "description": t.description,
                                         "parameters": t.parameters} for t in tools],
            "envace.episode.id": ep.id, "envace.task_id": ep.task_id, "envace.created_at": ep.created_at,
            "envace.end_reason": ep.end_reason, "envace.adapter": ep.adapter,
            "envace.trace.format": src.format if src else None, "envace.trace.file": src.file if src else None,
            "envace.trace.id": src.trace_id if src else None, "envace.trace.system": src.system if src else None,
            "envace.trace.turns": turns, "envace.trace.tools": [t.model_dump() for t in tools],
            "envace.trace.missing": src.missing if src else [],
        }), "status": {}}]
    for step in ep.steps:
        b = step.chosen_branch
        s_start = _ns(step.created_at)
        span: dict[str, Any] = {
            "traceId": trace_id, "spanId": _hex("step", ep.id, step.index, n=16), "parentSpanId": root_id,
            "kind": SPAN_KIND_INTERNAL, "startTimeUnixNano": str(s_start),
            "endTimeUnixNano": str(s_start + int(step.duration_s * 1e9)), "status": {}}
        common = {"envace.step.turn": step.turn, "envace.step.created_at": step.created_at}
        if b.kind == "answer":
            span["name"] = "chat"
            span["attributes"] = _attributes({
                "gen_ai.operation.name": "chat", "gen_ai.request.model": ep.model,
                "gen_ai.output.messages": [{"role": "assistant", "parts": [{"type": "text", "content": b.action_text}],
                                            "finish_reason": "stop"}], **common})
        else:
            name = b.call.name if b.call else UNPARSED_CALL
            said = b.action_text.rpartition("\n")[2]
            attrs: dict[str, Any] = {
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name, "gen_ai.tool.type": "function",
                "gen_ai.tool.call.id": f"step-{step.index}",
                "gen_ai.tool.call.arguments": json.dumps(b.call.arguments, ensure_ascii=False) if b.call else said,
                "gen_ai.tool.call.result": json.dumps(b.actual, ensure_ascii=False) if b.actual_source else None,
                "envace.step.action_text": b.action_text, "envace.step.parse_error": b.parse_error, **common}
            if b.predicted_text is not None or b.predicted is not None:
                attrs["rehearsal.predicted"] = json.dumps(b.predicted, ensure_ascii=False)
                attrs["rehearsal.predicted_text"] = b.predicted_text
                attrs.update({f"rehearsal.{m}": getattr(b.metrics, m) for m in REHEARSAL_ATTRIBUTES})
            span["name"] = f"execute_tool {name}"
            span["attributes"] = _attributes(attrs)
            if b.actual_error:
                span["status"] = {"code": STATUS_ERROR, "message": _error_text(b.actual)}
        spans.append(span)
    return {"resourceSpans": [{"resource": {"attributes": _attributes({"service.name": "envace-inspector"})},
                               "scopeSpans": [{"scope": {"name": "app.trace_io.otlp"}, "spans": spans}]}]}


def _is_hex(text: str) -> bool:
    try:
        binascii.unhexlify(text)
    except (binascii.Error, ValueError):
        return False
    return True


def _error_text(actual: Any) -> str:
    if isinstance(actual, dict) and "error" in actual:
        return str(actual["error"])
    return canonical_json(actual)[:200]


def write_otlp(episodes: Iterable[Episode], out: str | os.PathLike[str]) -> int:
    """Write episodes as OTLP/JSON lines (one request per episode) to `out`, replaced atomically; returns how many."""
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp")
    n = 0
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for ep in episodes:
                f.write(json.dumps(episode_spans(ep), ensure_ascii=False) + "\n")
                n += 1
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return n


__all__ = ["episode_spans", "parse_otlp", "write_otlp"]
