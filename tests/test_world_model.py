"""The world model for other agents: `rehearse` and `propose` on the caller's tools, and the
inspector as an MCP server (`serve --mcp`) answered by the real embedded agent."""
import asyncio
import json

import pytest

from app import envs
from app.cli.main import build_parser
from app.engine import EpisodeRunner
from app.engine.world_model import (WorldModel, WorldModelInputError, parse_call, parse_history,
                                    parse_tools)
from app.records import RunSettings
from fake_openai import free_port
from scripted import ScriptedPolicy

TASK = "bfcl:multi_turn_base_3"  # held-out (index mod 4 == 3)


def mcp_tools(task_id: str = TASK) -> list[dict]:
    """The task's tools as an MCP server lists them."""
    env = envs.make_env(envs.load_task(task_id))
    return [{"name": t.name, "description": t.description, "inputSchema": t.parameters,
             **({"outputSchema": t.response} if t.response else {}),
             "annotations": {"readOnlyHint": t.read_only}} for t in env.tools()]


def first_message(task_id: str = TASK) -> list[dict]:
    return [{"role": "user", "content": envs.load_task(task_id).turns[0][0]["content"]}]


# ---------------------------------------------------------------- input (no model needed)


def test_tools_in_mcp_and_openai_form_read_the_same():
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    mcp = parse_tools([{"name": "cat", "description": "read", "inputSchema": schema,
                        "outputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}}])
    openai = parse_tools(json.dumps([{"type": "function", "function": {"name": "cat", "description": "read",
                                                                        "parameters": schema}}]))
    assert mcp[0].parameters == openai[0].parameters == schema
    assert mcp[0].read_only and not openai[0].read_only and mcp[0].response == {"type": "object"}


@pytest.mark.parametrize("tools, message", [
    ([], "non-empty list"),
    ("not json", "not valid JSON"),
    ([{"description": "no name"}], "needs a string `name`"),
    ([{"name": "a", "inputSchema": {"type": "array"}}], "JSON object schema"),
    ([{"name": "a"}, {"name": "a"}], "two tools are named 'a'"),
    # the JSON Schema meta-schema: each of these used to reach tool_signature (AttributeError) or pass silently
    ([{"name": "cat", "inputSchema": {"type": "object", "properties": 5}}],
     r"tools\[0\] \(cat\): inputSchema is not a valid JSON schema: properties: 5 is not of type 'object'$"),
    ([{"name": "cat", "inputSchema": {"type": "object", "properties": {"file_name": "string"}}}],
     r"inputSchema is not a valid JSON schema: properties.file_name: 'string' is not of type 'object', 'boolean'$"),
    ([{"name": "cat", "inputSchema": {"type": "object", "properties": {"file_name": {"type": "string"}},
                                      "required": "file_name"}}],
     r"inputSchema is not a valid JSON schema: required: 'file_name' is not of type 'array'$"),
    ([{"type": "function", "function": {"name": "cat", "parameters": {"type": "object",
                                                                      "properties": {"n": {"type": "int"}}}}}],
     r"tools\[0\] \(cat\): parameters is not a valid JSON schema: properties.n.type: 'int' is not valid"),
    ([{"name": "cat", "outputSchema": {"type": "object", "required": [1]}}],
     r"outputSchema is not a valid JSON schema: required.0: 1 is not of type 'string'$"),
])
def test_bad_tools_say_what_to_fix(tools, message):
    with pytest.raises(WorldModelInputError, match=message):
        parse_tools(tools)


def test_an_error_about_a_name_with_a_newline_stays_on_one_line():
    """Found by the fuzz test in CI: a tool named "0\\n" broke the one-line message the client shows."""
    with pytest.raises(WorldModelInputError) as bad_schema:
        parse_tools([{"name": "0\n", "inputSchema": {"type": "object", "properties": None}}])
    assert "\n" not in str(bad_schema.value) and str(bad_schema.value).startswith("tools[0] (0\\n): inputSchema")
    with pytest.raises(WorldModelInputError) as unknown:
        parse_call({"name": "cat", "arguments": {}}, parse_tools([{"name": "0\n0"}]))
    assert str(unknown.value) == "unknown tool 'cat'; the tools are: 0\\n0"


def test_bad_calls_and_history_say_what_to_fix():
    tools = parse_tools([{"name": "ls"}])
    with pytest.raises(WorldModelInputError, match="unknown tool 'rm'; the tools are: ls"):
        parse_call({"name": "rm", "arguments": {}}, tools)
    with pytest.raises(WorldModelInputError, match="arguments must be a JSON object"):
        parse_call({"name": "ls", "arguments": [1]}, tools)
    assert parse_call({"name": "ls", "arguments": '{"a": 1}'}, tools).arguments == {"a": 1}  # OpenAI sends a string
    with pytest.raises(WorldModelInputError, match=r"history\[0\]: role must be"):
        parse_history([{"role": "system", "content": "x"}])
    with pytest.raises(WorldModelInputError, match=r"history\[1\]: content must be a string"):
        parse_history([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}])
    history = parse_history([{"role": "user", "content": "list"},
                             {"role": "assistant", "tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}]},
                             {"role": "tool", "content": '{"current_directory_content": ["a"]}'}])
    assert [h.role for h in history] == ["user", "assistant", "tool"]
    assert history[1].call.name == "ls" and history[2].result == {"current_directory_content": ["a"]}


@pytest.mark.parametrize("arguments, message", [
    ({}, "'file_name' is a required property"),
    ({"file_name": 3}, "file_name: 3 is not of type 'string'"),
    ({"file_name": "a.txt", "lines": "ten"}, "lines: 'ten' is not of type 'integer'"),
])
def test_call_arguments_that_fail_the_schema_are_refused_before_any_model_call(arguments, message):
    tools = [{"name": "cat", "inputSchema": {"type": "object", "required": ["file_name"], "properties": {
        "file_name": {"type": "string"}, "lines": {"type": "integer"}}}}]
    policy = ScriptedPolicy([])
    with pytest.raises(WorldModelInputError, match=f"^call.arguments do not fit the inputSchema of cat: {message}$"):
        WorldModel(policy).rehearse(tools, [], {"name": "cat", "arguments": arguments})
    assert policy.rehearse_calls == [] and policy.act_calls == []
    out = WorldModel(policy).rehearse(tools, [], {"name": "cat", "arguments": {"file_name": "a.txt", "lines": None}})
    assert out.call == {"name": "cat", "arguments": {"file_name": "a.txt", "lines": None}}  # null: not given
    assert len(policy.rehearse_calls) == 1


def test_k_out_of_range_is_refused_before_any_model_call():
    policy = ScriptedPolicy([])  # an engine unit test: the scripted policy must never be asked
    for k in (0, 9, 2.5, True, "3", float("inf"), float("nan")):
        with pytest.raises(WorldModelInputError, match="k must be a whole number from 1 to 8"):
            WorldModel(policy).propose([{"name": "ls"}], [], k)
    assert policy.act_calls == [] and policy.rehearse_calls == []


def test_serve_has_an_mcp_flag():
    assert build_parser().parse_args(["serve", "--mcp"]).mcp is True
    assert build_parser().parse_args(["serve"]).mcp is False


# ---------------------------------------------------------------- the real agent


@pytest.mark.slow
def test_propose_is_the_runners_parallel_step_without_executing(shipped_policy):
    # Same prompts, same constrained decoding, same dedup and scores as a parallel step of the runner.
    settings = RunSettings(mode="parallel", branches=2, selector="logprob", seed=0, shadow=False)
    runner = EpisodeRunner(envs.load_task(TASK), shipped_policy, settings)
    state_before = runner.env.state()
    step = runner.step()
    candidates = WorldModel(shipped_policy).propose(mcp_tools(), first_message(), 2)
    assert [c.action_text for c in candidates] == [b.action_text for b in step.branches]
    assert [c.score for c in candidates] == [b.scores["logprob"] for b in step.branches]
    assert [c.chosen for c in candidates] == [b.chosen for b in step.branches]
    names = {t["name"] for t in mcp_tools()}
    for c, b in zip(candidates, step.branches):
        if c.kind == "call":
            assert c.call["name"] in names and c.rehearsal is not None
            assert (c.rehearsal.predicted_text, c.rehearsal.predicted) == (b.predicted_text, b.predicted)
            assert c.rehearsal.valid == (b.predicted is not None)
            # a prediction that parsed has a confidence; one cut off by the token budget has none
            assert (c.rehearsal.confidence is not None) == c.rehearsal.valid
            assert c.rehearsal.confidence is None or 0 < c.rehearsal.confidence <= 1
    assert envs.make_env(envs.load_task(TASK)).state() == state_before  # nothing ran anywhere


@pytest.mark.slow
def test_rehearse_predicts_a_json_response_with_its_confidence(shipped_policy):
    tools = mcp_tools()
    out = WorldModel(shipped_policy).rehearse(tools, first_message(), {"name": "ls", "arguments": {}})
    assert out.valid and out.predicted is not None and out.call == {"name": "ls", "arguments": {}}
    assert out.predicted_text.startswith("<execution_result>")
    assert 0 < out.confidence <= 1
    # Arguments that fail the tool's schema are refused at the boundary (issue 38), before the model runs.
    with pytest.raises(WorldModelInputError, match="call.arguments do not fit the inputSchema of cd: folder: 3"):
        WorldModel(shipped_policy).rehearse(tools, first_message(), {"name": "cd", "arguments": {"folder": 3}})


@pytest.mark.slow
def test_the_inspector_is_an_mcp_server_with_rehearse_and_propose(shipped_policy, tmp_path):
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from app.ui import build_demo, close_demo

    demo = build_demo(db_path=str(tmp_path / "mcp.db"), policy_loader=lambda model, adapter: shipped_policy, mcp=True)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, mcp_server=True, quiet=True)

    async def session():
        async with streamable_http_client(f"http://127.0.0.1:{port}/gradio_api/mcp/") as streams:
            async with ClientSession(streams[0], streams[1]) as s:
                await s.initialize()
                listed = (await s.list_tools()).tools
                called = await s.call_tool("rehearse", {"tools": mcp_tools(), "history": first_message(),
                                                        "call": {"name": "pwd", "arguments": {}}})
                bad = await s.call_tool("rehearse", {"tools": mcp_tools(), "history": [],
                                                     "call": {"name": "format_disk", "arguments": {}}})
                return listed, called, bad

    try:
        listed, called, bad = asyncio.run(asyncio.wait_for(session(), timeout=300))
    finally:
        close_demo(demo)
    assert {t.name for t in listed} == {"rehearse", "propose"}  # the UI's endpoints are not tools
    rehearse_tool = next(t for t in listed if t.name == "rehearse")
    assert "before spending the real call" in rehearse_tool.description
    assert set(rehearse_tool.inputSchema["properties"]) == {"tools", "history", "call"}
    assert not called.isError
    body = json.loads(called.content[0].text)
    assert body["valid"] and body["call"]["name"] == "pwd" and 0 < body["confidence"] <= 1
    assert bad.isError and "unknown tool 'format_disk'" in bad.content[0].text


def test_mcp_clients_read_what_to_fix_in_bad_schemas_and_arguments(tmp_path):
    """Through the MCP protocol (`serve --mcp`): each bad input is the tool's error, one line that says what to
    fix, not Gradio's generic "has raised an exception". No model is needed (a scripted one is never asked)."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    from app.ui import build_demo, close_demo

    policy = ScriptedPolicy([])
    demo = build_demo(db_path=str(tmp_path / "mcp.db"), policy_loader=lambda model, adapter: policy, mcp=True)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, mcp_server=True, quiet=True)
    cat = {"type": "object", "properties": {"file_name": {"type": "string"}}, "required": ["file_name"]}
    cases = [
        ({"name": "cat", "inputSchema": {"type": "object", "properties": 5}}, {"file_name": "a"},
         "tools[0] (cat): inputSchema is not a valid JSON schema: properties: 5 is not of type 'object'"),
        ({"name": "cat", "inputSchema": {"type": "object", "properties": {"file_name": "string"}}}, {"file_name": "a"},
         "properties.file_name: 'string' is not of type 'object', 'boolean'"),
        ({"name": "cat", "inputSchema": {**cat, "required": "file_name"}}, {"file_name": "a"},
         "required: 'file_name' is not of type 'array'"),
        ({"name": "cat", "inputSchema": cat}, {"file_name": 7},
         "call.arguments do not fit the inputSchema of cat: file_name: 7 is not of type 'string'"),
    ]

    async def session():
        async with streamable_http_client(f"http://127.0.0.1:{port}/gradio_api/mcp/") as streams:
            async with ClientSession(streams[0], streams[1]) as s:
                await s.initialize()
                out = [await s.call_tool("rehearse", {"tools": [tool], "history": [],
                                                      "call": {"name": "cat", "arguments": args}})
                       for tool, args, _ in cases]
                out.append(await s.call_tool("propose", {"tools": [cases[0][0]], "history": [
                    {"role": "user", "content": "show a"}], "k": 2}))
                return out

    try:
        results = asyncio.run(asyncio.wait_for(session(), timeout=120))
    finally:
        close_demo(demo)
    for result, (_, _, message) in zip(results, cases + [cases[0]]):
        text = result.content[0].text
        assert result.isError and message in text and "\n" not in text.strip(), text
        assert "raised an exception" not in text
    assert policy.act_calls == [] and policy.rehearse_calls == []
