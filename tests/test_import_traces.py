"""Importing other software's traces (issue 37): chat JSONL and OTLP/JSON from third-party fixtures, the recorded
environment, OTLP/JSON export with the rehearsal attached, and bad input refused whole."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from app.cli.main import main
from app.engine import EpisodeRunner
from app.envs import RecordedEnvironment, make_env, make_judge
from app.envs.recorded import FORK_REFUSED, NOT_RECORDED
from app.records import Call, Metrics
from app.service.catalog import episode_task, task_turns
from app.store import Store
from app.trace_io import (MAX_IMPORT_BYTES, TraceFileError, export_otlp, import_records, parse_foreign,
                          read_foreign)
from app.trace_io.imported import NO_RECORDED_RESPONSE
from app.trace_io.otlp import episode_spans, parse_otlp
from app.ui import render
from tests.scripted import ScriptedPolicy

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "third_party"
OPENAI = FIXTURES / "openai_chat.jsonl"
SMOLAGENTS = FIXTURES / "smolagents_openinference.jsonl"
SMOLAGENTS_GENAI = FIXTURES / "smolagents_genai.jsonl"


def _episodes(path: Path, fmt: str):
    return [r.episode for r in read_foreign(path, fmt)]


# ---------------------------------------------------------------- the openai-python + datasets transcript


def test_openai_chat_fixture_becomes_episodes_with_real_responses() -> None:
    first, second = _episodes(OPENAI, "openai")
    assert first.task_id == "trace:openai/openai_chat.jsonl#1" and first.status == "finished"
    assert first.trace.system == "You answer weather questions with the tools."
    assert first.trace.turns == [[{"role": "user", "content": "Weather in Paris, in Fahrenheit?"}],
                                 [{"role": "user", "content": "And Oslo and Atlantis?"}]]
    kinds = [(s.turn, s.kind, s.chosen_branch.call.name if s.chosen_branch.call else None) for s in first.steps]
    assert kinds == [(0, "call", "get_weather"), (0, "call", "to_fahrenheit"), (0, "answer", None),
                     (1, "call", "get_weather"), (1, "call", "get_weather"), (1, "answer", None)]
    b = first.steps[0].chosen_branch
    assert b.call.arguments == {"city": "Paris"} and b.actual == {"temp_c": 18, "sky": "cloudy"}
    assert b.actual_source == "committed" and b.actual_error is False and b.predicted is None
    assert first.steps[1].chosen_branch.actual == 64.4
    atlantis = first.steps[4].chosen_branch
    assert atlantis.call.arguments == {"city": "Atlantis"} and atlantis.actual_error is True
    assert first.steps[5].chosen_branch.action_text.startswith("Oslo: snow")
    # What the file did not record, or recorded wrongly, is said, not filled in.
    assert "the agent's model is not recorded" in first.trace.missing and first.model == "unknown"
    assert any("schema of celsius is null" in m for m in first.trace.missing)
    weather = next(t for t in first.trace.tools if t.name == "get_weather")
    assert weather.parameters["properties"] == {"city": {"type": "string"}}
    assert len(second.steps) == 2 and second.id != first.id


# ---------------------------------------------------------------- the smolagents + OpenInference spans


def test_smolagents_openinference_spans_become_episodes() -> None:
    paris, atlantis = _episodes(SMOLAGENTS, "otlp")
    assert paris.model == "scripted-stand-in" and paris.task_id.startswith("trace:otlp/")
    assert paris.trace.turns == [[{"role": "user", "content": "New task:\nWhat is the weather in Paris, in Fahrenheit?"}]]
    assert paris.trace.system.startswith("You are an expert assistant")
    assert [s.chosen_branch.call.name for s in paris.steps] == ["get_weather", "to_fahrenheit", "final_answer"]
    assert paris.steps[0].chosen_branch.call.arguments == {"city": "Paris"}
    assert paris.steps[0].chosen_branch.actual == {"temp_c": 18, "sky": "cloudy"}
    assert paris.steps[1].chosen_branch.actual == 64.4
    tools = {t.name: t for t in paris.trace.tools}
    assert tools["get_weather"].parameters["properties"]["city"]["type"] == "string"  # from llm.tools.N
    assert paris.trace.missing == []
    # The failed call: status ERROR, no output.value; its status message is the recorded response.
    failed = atlantis.steps[0].chosen_branch
    assert failed.actual_error is True and "unknown city 'Atlantis'" in failed.actual["error"]


def test_openai_v2_genai_spans_keep_the_calls_and_say_what_is_missing() -> None:
    episodes = _episodes(SMOLAGENTS_GENAI, "otlp")
    # Only the openai client was instrumented: each chat completion is a trace of its own, one decided call each.
    calls = [(ep.steps[0].chosen_branch.call.name, ep.steps[0].chosen_branch.call.arguments) for ep in episodes]
    assert sorted(calls, key=str) == sorted([("get_weather", {"city": "Paris"}), ("to_fahrenheit", {"celsius": 18}),
                                             ("final_answer", {"answer": "Cloudy, 64.4 F"}),
                                             ("get_weather", {"city": "Atlantis"}),
                                             ("final_answer", {"answer": "I could not find Atlantis."})], key=str)
    for ep in episodes:
        b = ep.steps[0].chosen_branch
        assert ep.model == "scripted-stand-in" and len(ep.steps) == 1
        assert b.actual is None and b.not_executed == NO_RECORDED_RESPONSE
        assert "step 0: no result recorded for " + b.call.name in ep.trace.missing
        assert "the content of some user messages is not recorded" in ep.trace.missing and ep.trace.turns == []


@pytest.mark.parametrize("path,fmt", [(OPENAI, "openai"), (SMOLAGENTS, "otlp"), (SMOLAGENTS_GENAI, "otlp")])
def test_round_trip_import_export_import_gives_the_same_episodes(path: Path, fmt: str, tmp_path: Path) -> None:
    store = Store(tmp_path / "a.db")
    import_records(store, read_foreign(path, fmt))
    first = [store.get_episode(r["id"]) for r in reversed(store.list_episodes())]
    out = tmp_path / "out.otlp.jsonl"
    assert export_otlp(store, out) == len(first)
    again = Store(tmp_path / "b.db")
    import_records(again, read_foreign(out, "otlp"))
    second = [again.get_episode(ep.id) for ep in first]
    assert [e.model_dump() for e in second] == [e.model_dump() for e in first]


def test_rehearsal_exports_as_tool_span_attributes_and_comes_back(tmp_path: Path) -> None:
    ep = _episodes(OPENAI, "openai")[0]
    b = ep.steps[0].chosen_branch
    b.predicted, b.predicted_text = {"temp_c": 20, "sky": "cloudy"}, '{"temp_c": 20, "sky": "cloudy"}'
    b.metrics = Metrics(json_valid=True, exact=False, field_f1=0.5, error_agree=True, surprise=1.25)
    request = episode_spans(ep)
    spans = request["resourceSpans"][0]["scopeSpans"][0]["spans"]
    tool = next(s for s in spans if s["name"] == "execute_tool get_weather")
    attrs = {a["key"]: a["value"] for a in tool["attributes"]}
    assert attrs["rehearsal.exact"] == {"boolValue": False} and attrs["rehearsal.field_f1"] == {"doubleValue": 0.5}
    assert json.loads(attrs["rehearsal.predicted"]["stringValue"]) == {"temp_c": 20, "sky": "cloudy"}
    assert json.loads(attrs["gen_ai.tool.call.result"]["stringValue"]) == {"temp_c": 18, "sky": "cloudy"}
    error_span = next(s for s in spans if s.get("status", {}).get("code") == 2)
    assert "Atlantis" in error_span["status"]["message"]
    back = parse_otlp((json.dumps(request) + "\n").encode())[0]
    assert back.model_dump() == ep.model_dump()


# ---------------------------------------------------------------- OpenTelemetry GenAI attributes


def _span(trace: str, span: str, name: str, start: int, attrs: dict, parent: str = "", status: dict | None = None):
    def value(v):
        return {"stringValue": v if isinstance(v, str) else json.dumps(v)}
    return {"traceId": trace, "spanId": span, "parentSpanId": parent, "name": name, "kind": 1,
            "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 1000),
            "attributes": [{"key": k, "value": value(v)} for k, v in attrs.items()], "status": status or {}}


def _genai_file(with_result: bool = True) -> bytes:
    t = "0af7651916cd43dd8448eb211c80319c"
    tool_attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "lookup",
                  "gen_ai.tool.call.id": "c1", "gen_ai.tool.call.arguments": '{"sku": "A-1"}'}
    if with_result:
        tool_attrs["gen_ai.tool.call.result"] = '{"stock": 3}'
    spans = [
        _span(t, "b7ad6b7169203331", "chat shop-model", 1_796_000_000_000_000_000, {
            "gen_ai.operation.name": "chat", "gen_ai.request.model": "shop-model",
            "gen_ai.system_instructions": [{"type": "text", "content": "Be brief."}],
            "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": "Is A-1 in stock?"}]}],
            "gen_ai.tool.definitions": [{"type": "function", "name": "lookup", "description": "Stock of a SKU.",
                                         "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}}}],
            "gen_ai.output.messages": [{"role": "assistant", "parts": [
                {"type": "tool_call", "id": "c1", "name": "lookup", "arguments": {"sku": "A-1"}}]}]}),
        _span(t, "00f067aa0ba902b7", "execute_tool lookup", 1_796_000_000_100_000_000, tool_attrs),
        _span(t, "00f067aa0ba902b8", "chat shop-model", 1_796_000_000_200_000_000, {
            "gen_ai.operation.name": "chat",
            "gen_ai.output.messages": [{"role": "assistant", "parts": [{"type": "text", "content": "Yes, 3."}]}]}),
    ]
    return (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}) + "\n").encode()


def test_genai_attributes_import() -> None:
    (ep,) = [r.episode for r in parse_foreign(_genai_file(), "otlp", "shop.jsonl")]
    assert ep.model == "shop-model" and ep.trace.system == "Be brief."
    assert ep.trace.turns == [[{"role": "user", "content": "Is A-1 in stock?"}]]
    assert [s.kind for s in ep.steps] == ["call", "answer"]
    call = ep.steps[0].chosen_branch
    assert call.call == Call(name="lookup", arguments={"sku": "A-1"}) and call.actual == {"stock": 3}
    assert ep.steps[1].chosen_branch.action_text == "Yes, 3." and ep.trace.tools[0].description == "Stock of a SKU."


def test_a_span_without_a_result_is_imported_and_says_so() -> None:
    (ep,) = [r.episode for r in parse_foreign(_genai_file(with_result=False), "otlp")]
    b = ep.steps[0].chosen_branch
    assert b.actual is None and b.actual_source is None and b.not_executed == NO_RECORDED_RESPONSE
    assert "step 0: no result recorded for lookup" in ep.trace.missing
    assert "no recorded response" in render.branch_cards(ep.steps[0])


# ---------------------------------------------------------------- bad input: refused whole, nothing written


def _transcript(messages: list, tools: list | None = None) -> str:
    return json.dumps({"messages": messages, "tools": tools or []})


GOOD = _transcript([{"role": "user", "content": "hi"},
                    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                          "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "{}"}])


@pytest.mark.parametrize("text,message", [
    (GOOD + "\n" + _transcript([{"role": "user", "content": "x"},
                                {"role": "tool", "tool_call_id": "nope", "content": "1"}]),
     "line 2: messages[1] answers call id 'nope', which no assistant message before it made"),
    (GOOD + "\n" + GOOD[:40], "line 2: not JSON"),
    (GOOD + "\n" + _transcript([{"role": "robot", "content": "x"}]), "line 2: messages[0] has role 'robot'"),
    (GOOD + "\n" + GOOD, "the same trace as line 1"),
    ('{"rows": []}', "line 1: not a chat transcript"),
])
def test_bad_chat_files_are_refused_whole_with_the_line(tmp_path: Path, capsys, text: str, message: str) -> None:
    path, db = tmp_path / "bad.jsonl", tmp_path / "t.db"
    path.write_text(text + "\n")
    assert main(["import", "--format", "openai", str(path), "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert message in err and "nothing was imported" in err and len(err.strip().splitlines()) == 1
    assert not db.exists()  # checked in full before the database opens


def test_a_truncated_span_file_is_refused_with_its_line(tmp_path: Path) -> None:
    data = SMOLAGENTS.read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[: len(data) - 200])
    n = data.count(b"\n")
    with pytest.raises(TraceFileError, match=f"line {n}: not JSON"):
        read_foreign(cut, "otlp")


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.replace('"traceId": "', '"traceId": "zz', 1), "line 1: traceId 'zz0af7651916cd43dd8448eb211c80319c' is not hex"),
    (lambda d: d.replace('"spans"', '"spanz"', 1), "line 1: not OTLP/JSON"),
    (lambda d: d.replace('{"key": "gen_ai.tool.name", "value": {"stringValue": "lookup"}}, ', ""),
     "line 1, span 00f067aa0ba902b7: a tool span without a tool name"),
    (lambda d: d.replace('"resourceSpans"', '"resources"'), "line 1: not an OTLP trace export"),
])
def test_malformed_otlp_is_refused_with_its_line_and_span(mutate, message) -> None:
    text = _genai_file().decode()
    bad = mutate(text)
    assert bad != text
    with pytest.raises(TraceFileError, match=re.escape(message)):
        parse_foreign(bad.encode(), "otlp")


def test_imported_traces_round_trip_through_the_episodes_format(tmp_path: Path) -> None:
    from app.trace_io import export_episodes, parse_traces

    store = Store(tmp_path / "a.db")
    import_records(store, read_foreign(OPENAI, "openai"))
    out = tmp_path / "episodes.jsonl"
    export_episodes(store, out)
    back = parse_traces(out.read_bytes())
    assert [r.episode.trace.missing for r in back] == [store.get_episode(r.episode.id).trace.missing for r in back]
    assert all(r.episode.model_dump() == store.get_episode(r.episode.id).model_dump() for r in back)


def test_a_64_mib_upload_is_refused_by_its_size_before_reading(tmp_path: Path, monkeypatch) -> None:
    big = tmp_path / "big.jsonl"
    with big.open("wb") as f:
        f.truncate(MAX_IMPORT_BYTES + 1)  # sparse: 64 MiB and a byte, nothing written to disk
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("read a file over the limit"))
    for fmt in ("openai", "otlp"):
        with pytest.raises(TraceFileError, match="the file is 64 MiB; the limit is 64 MiB"):
            read_foreign(big, fmt)


def test_the_traces_tab_upload_imports_and_refuses(tmp_path: Path) -> None:
    from app.service import RunSession, Services
    from app.ui.traces_callbacks import TracesCallbacks

    services = Services(str(tmp_path / "ui.db"), lambda model, adapter: None, compute_ahead=False)
    cb = TracesCallbacks(services)
    upload = tmp_path / "upload.jsonl"
    shutil.copy(OPENAI, upload)
    said = cb.import_traces(str(upload), "openai", False)
    assert "Imported 2 trace(s)" in said and "model is not recorded" in said
    assert len(services.store.list_episodes()) == 2
    said = cb.import_traces(str(upload), "openai", False)  # the same file again: refused whole
    assert "Nothing was imported" in said and "already in" in said
    ep = services.store.get_episode(services.store.list_episodes()[0]["id"])
    opened = cb.open_episode(ep.id)
    assert opened[1].id == ep.id and "get_weather" in opened[5]
    assert "**Imported** from `upload.jsonl` (openai" in opened[2] and "model is not recorded" in opened[2]
    assert f"imported trace: {len(ep.steps)} recorded steps, ending with the agent's answer" in opened[2]
    said = cb.continue_episode(ep.id, RunSession(), [])[0]  # Continue: refused, with the reason
    assert "imported trace: it cannot be continued" in said
    path, message = cb.export_listed_otlp([[r["id"]] for r in services.store.list_episodes()])
    assert "Exported 2 episode(s)" in message and len(parse_otlp(Path(path).read_bytes())) == 2


def test_hostile_strings_are_rendered_escaped(tmp_path: Path) -> None:
    evil = '<img src=x onerror="alert(1)">'
    text = _transcript([{"role": "user", "content": f"<script>alert('u')</script>"},
                        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                              "function": {"name": evil, "arguments": json.dumps({"q": evil})}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": f"<script>alert('r')</script>{evil}"}])
    (ep,) = [r.episode for r in parse_foreign(text.encode(), "openai")]
    html = render.branch_cards(ep.steps[0])
    assert "<img" not in html and "<script" not in html and "&lt;img" in html
    chat = render.chat_messages(task_turns(ep.task_id, ep), ep.steps, upto=0)
    # The chat is Markdown: hostile text stays inside code (rendered as text) or is backslash-escaped.
    for m in chat:
        outside = re.sub(r"```.*?```|`[^`]*`", "", m["content"], flags=re.S).replace("\\<", "")
        assert "<" not in outside, m["content"]


# ---------------------------------------------------------------- the recorded environment


def test_recorded_environment_answers_recorded_calls_only() -> None:
    ep = _episodes(OPENAI, "openai")[0]
    task = episode_task(ep)
    env = make_env(task)
    assert isinstance(env, RecordedEnvironment) and {t.name for t in env.tools()} == {"get_weather", "to_fahrenheit"}
    paris = env.call("get_weather", {"city": "Paris"})
    assert paris.output == {"temp_c": 18, "sky": "cloudy"} and not paris.error and paris.missing is None
    assert env.call("get_weather", {"city": "Atlantis"}).error is True
    again = env.call("get_weather", {"city": "Paris"})  # recorded once: the second has no recording
    assert again.output is None and again.missing == NOT_RECORDED
    assert env.call("get_weather", {"city": "Rome"}).missing == NOT_RECORDED
    with pytest.raises(RuntimeError, match="cannot fork"):
        env.fork()
    assert make_judge(task).check_turn(0, env, []).details["judged"] is False


def test_a_run_on_a_recorded_trace_marks_unrecorded_calls_and_refused_forks() -> None:
    ep = _episodes(OPENAI, "openai")[1]
    task = episode_task(ep)
    rome = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    oslo = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    policy = ScriptedPolicy([[oslo, rome], [rome], ["Done."]], predict=lambda _: {"temp_c": 1})
    from app.records import RunSettings

    runner = EpisodeRunner(task, policy, RunSettings(mode="parallel", branches=2, selector="logprob",
                                                     keep_primary=True), model="scripted")
    first = runner.step()
    chosen, other = first.chosen_branch, first.branches[1 - first.chosen]
    assert chosen.call.arguments == {"city": "Oslo"} and chosen.actual == {"temp_c": 4, "sky": "snow"}
    assert other.actual is None and other.not_executed == FORK_REFUSED
    second = runner.step()
    b = second.chosen_branch
    assert b.call.arguments == {"city": "Rome"} and b.actual is None and b.actual_source is None
    assert b.not_executed == NOT_RECORDED and b.metrics.exact is None
    assert "no recorded response" in render.branch_cards(second)


# ---------------------------------------------------------------- through the served app (the tab's upload, its API)


def test_the_served_traces_tab_imports_an_upload_and_exports_otlp(tmp_path: Path) -> None:
    from gradio_client import Client, handle_file

    from app.ui import build_demo, close_demo

    demo = build_demo(db_path=str(tmp_path / "ui.db"), policy_loader=lambda model, adapter: None)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        c = Client(url, verbose=False)
        said = c.predict(handle_file(str(SMOLAGENTS)), "otlp", False, api_name="/import_traces")
        assert "Imported 2 trace(s) as episodes" in said
        assert demo.services.store.db["episodes"].count == 2
        bad = tmp_path / "bad.jsonl"
        bad.write_text(OPENAI.read_text() + '{"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}\n')
        said = c.predict(handle_file(str(bad)), "openai", False, api_name="/import_traces")
        assert "Nothing was imported: line 3: messages[0] answers call id &#x27;x&#x27;" in said
        assert demo.services.store.db["episodes"].count == 2  # the two good lines were not written either
        ids = [r["id"] for r in demo.services.store.list_episodes()]
        download, said = c.predict({"headers": ["id"], "data": [[i] for i in ids]}, api_name="/export_otlp")
        assert "Exported 2 episode(s) as OTLP/JSON traces." in said
        assert sorted(ep.id for ep in parse_otlp(Path(download).read_bytes())) == sorted(ids)
    finally:
        close_demo(demo)
