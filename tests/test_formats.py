import json

import pytest

from app.envs.base import Tool
from app.formats import (HistoryItem, act_prompt, canonical_json, fit_history, parse_action, parse_result,
                         rehearse_prompt, render_tools, tool_signature)
from app.records import Call
from app.divergence import compare, field_f1, flatten


def count(text: str) -> int:
    return max(1, len(text) // 4)


TOOLS = [
    Tool(name="ls", description="List files. Long details follow here.", read_only=True,
         parameters={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": []}),
    Tool(name="mv", description="Move a file. It can also rename.",
         parameters={"type": "object", "properties": {"source": {"type": "string"}, "destination": {"type": "string"}},
                     "required": ["source", "destination"]},
         response={"type": "object", "properties": {"result": {"type": "string"}}}),
]


@pytest.mark.parametrize("text,kind,name,args", [
    ('<tool_call>{"name": "mv", "arguments": {"source": "a", "destination": "b"}}</tool_call>', "call", "mv",
     {"source": "a", "destination": "b"}),
    ('<tool_call>{"name": "ls", "arguments": {}}', "call", "ls", {}),  # unclosed tag, valid JSON
    ('<tool_call>{"name": "ls"}</tool_call> trailing words', "call", "ls", {}),
    ('<tool_call>{"name": "ls", "arguments": "{\\"a\\": true}"}</tool_call>', "call", "ls", {"a": True}),
    ('<think>hmm</think><tool_call>{"name": "ls", "arguments": {"a": true}}</tool_call>', "call", "ls", {"a": True}),
    ('{"name": "ls", "arguments": {}}', "call", "ls", {}),  # bare JSON call
    ("All files were moved.", "answer", None, None),
])
def test_parse_action_calls_and_answers(text, kind, name, args):
    parsed = parse_action(text)
    assert parsed.kind == kind
    if kind == "call":
        assert parsed.call.name == name and parsed.call.arguments == args
    else:
        assert parsed.answer == text


@pytest.mark.parametrize("text,fragment", [
    ("", "empty output"),
    ("<tool_call>{not json</tool_call>", "invalid tool call"),
    ("<tool_call>{\"name\": \"ls\", \"arguments\": {", "unclosed"),
    ("<tool_call>{\"arguments\": {}}</tool_call>", "name"),
    ("<tool_call>{\"name\": \"ls\", \"arguments\": [1, 2]}</tool_call>", "arguments"),
    ("{\"foo\": 1}", "name"),
    ("ls -la </tool_call>", "without <tool_call>"),
    ("\x00\x01 <tool_call> garbage ]]]", "invalid tool call"),
])
def test_parse_action_errors_never_raise(text, fragment):
    parsed = parse_action(text)
    assert parsed.kind == "parse_error"
    assert fragment in parsed.error


@pytest.mark.parametrize("text,value,error", [
    ('<execution_result>{"a": 1}</execution_result>', {"a": 1}, None),
    ('{"a": [1, 2]}</execution_result>', {"a": [1, 2]}, None),  # after the prefill
    ('<think>x</think><execution_result>"ok"</execution_result>', "ok", None),
    ('<execution_result>{"a": 1} and more', {"a": 1}, None),
    ('<execution_result></execution_result>', None, "empty"),
    ('<execution_result>{"a": </execution_result>', None, "invalid JSON"),
])
def test_parse_result(text, value, error):
    got, err = parse_result(text)
    assert got == value
    assert (err is None) if error is None else (error in err)


def test_tool_signature_marks_optional_and_cuts_description():
    assert tool_signature(TOOLS[1]) == "mv(source: str, destination: str): Move a file."
    assert tool_signature(TOOLS[0]) == "ls(a?: bool): List files."


def test_render_tools_drops_descriptions_to_fit_budget():
    full = render_tools(TOOLS, count, budget=10_000)
    assert "Move a file." in full
    tight = render_tools(TOOLS, count, budget=count("ls(a?: bool)\nmv(source: str, destination: str)"))
    assert "Move a file." not in tight and "mv(source: str, destination: str)" in tight


def test_fit_history_keeps_user_turns_and_drops_oldest_calls():
    history = [HistoryItem("user", "first request")]
    for i in range(30):
        history.append(HistoryItem("assistant", f"call {i}", call=Call(name="ls")))
        history.append(HistoryItem("tool", "", result={"out": "x" * 300}))
    history.append(HistoryItem("user", "second request"))
    kept = fit_history(history, fixed_tokens=100, count_tokens=count, context_window=1000, reserve=100)
    assert [h.content for h in kept if h.role == "user"] == ["first request", "second request"]
    assert len(kept) < len(history)
    assert kept[-2].content != "call 0"  # the newest calls survive


def test_act_and_rehearse_prompts_share_a_prefix():
    history = [HistoryItem("user", "move a to b")]
    a = rehearse_prompt(TOOLS[0], Call(name="ls"), history)
    b = rehearse_prompt(TOOLS[1], Call(name="mv", arguments={"source": "a", "destination": "b"}), history)
    assert a.messages[0] == b.messages[0]
    assert a.messages[1]["content"].split("Tool:")[0] == b.messages[1]["content"].split("Tool:")[0]
    assert a.prefill == "<execution_result>"
    assert "Returns:" in b.messages[1]["content"]
    p = act_prompt(TOOLS, history, count, 8192)
    assert p.messages[0]["role"] == "system" and "mv(source: str" in p.messages[0]["content"]
    assert p.messages[-1] == {"role": "user", "content": "move a to b"}


def test_the_rehearse_prompts_state_is_the_tools_own_class_compact_and_cut_at_its_budget():
    from app.formats import STATE_CHARS, state_section

    ls = Tool(name="ls", description="List.", parameters={"type": "object", "properties": {}},
              env_class="GorillaFileSystem")
    state = {"GorillaFileSystem": {"root": {"a.txt": "hello"}}, "TwitterAPI": {"tweets": {"0": "secret"}}}
    text = rehearse_prompt(ls, Call(name="ls"), [], state).messages[1]["content"]
    assert 'Environment state (GorillaFileSystem):\n{"root":{"a.txt":"hello"}}' in text
    assert "secret" not in text  # another class's state cannot change this call's result
    assert "Environment state" not in rehearse_prompt(ls, Call(name="ls"), []).messages[1]["content"]
    # A tool with no class (or a state not keyed by classes) shows the whole state.
    assert state_section(TOOLS[0], {"k": 1}) == 'Environment state:\n{"k":1}'
    big = state_section(ls, {"GorillaFileSystem": {"x": "y" * 5000}})
    assert len(big.split("\n", 1)[1]) == STATE_CHARS and big.endswith("...")


def test_divergence_metrics():
    actual = {"files": ["a", "b"], "count": 2}
    exact = compare({"count": 2, "files": ["a", "b"]}, True, actual)
    assert exact.exact and exact.field_f1 == 1.0 and exact.error_agree
    partial = compare({"files": ["a", "c"], "count": 2}, True, actual)
    assert not partial.exact and 0 < partial.field_f1 < 1 and partial.error_agree
    wrong = compare({"error": "no such file"}, True, actual)
    assert wrong.error_agree is False and wrong.field_f1 == 0.0
    invalid = compare(None, False, actual)
    assert invalid.json_valid is False and invalid.exact is False
    assert field_f1({"a": {"b": 1}}, {"a": {"b": 1}, "c": 2}) == pytest.approx(2 / 3)
    assert flatten({"a": []}) == [("/a", "[]")]
    assert canonical_json({"b": 1, "a": 2}) == canonical_json(json.loads('{"a": 2, "b": 1}'))


def test_branch_key_is_the_canonical_call_or_the_folded_text() -> None:
    from app.formats import branch_key

    a = Call(name="ls", arguments={"a": True, "path": "x"})
    b = Call(name="ls", arguments={"path": "x", "a": True})
    assert branch_key("call", a, "anything") == branch_key("call", b, "else")  # argument order is not a difference
    assert branch_key("call", a, "") != branch_key("call", Call(name="ls", arguments={"a": False, "path": "x"}), "")
    assert branch_key("answer", None, "  Done,\n  thanks ") == branch_key("answer", None, "Done, thanks")
    assert branch_key("answer", None, "Done") != branch_key("parse_error", None, "Done")
