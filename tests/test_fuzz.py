"""Property-based fuzzing (hypothesis) of every parser of untrusted text.

Model output (`<tool_call>` and `<execution_result>`), BFCL's gold-call strings, corrections
typed in Annotate, episode JSONL imports, CLI option values and model specs. The property for
each: a valid, typed result or the parser's own clear error; never another exception, never a
partial write. Inputs mix free text with near-misses of the real format, where bugs hide.
"""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from app import envs
from app.cli import common, main as cli
from app.envs.bfcl_tasks import parse_call_string
from app.formats import RESULT_CLOSE, RESULT_OPEN, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_action, parse_result
from app.service import InputError, build_annotation
from app.records import LABELS, Annotation, Branch, Call, Episode, RunSettings, Step
from app.store import Store
from app.trace_io import TraceFileError, export_episodes, import_records, parse_traces
from model_backend import ModelSpec, ModelSpecError, parse_spec

EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
markup = st.sampled_from([TOOL_CALL_OPEN, TOOL_CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE, "<think>", "</think>",
                          "{", "}", "[", "]", '"', ":", ",", "\\", "\x00", "\u202e", "<script>"])
noisy_text = st.lists(st.text(max_size=12) | markup, max_size=12).map("".join)


def tool_call_like() -> st.SearchStrategy[str]:
    """`<tool_call>` + a JSON body that is sometimes a call, sometimes not, sometimes cut off."""
    body = st.one_of(
        st.builds(lambda n, a: json.dumps({"name": n, "arguments": a}), st.text(max_size=10), json_values),
        json_values.map(json.dumps), noisy_text)
    return st.builds(lambda pre, b, cut, close: pre + TOOL_CALL_OPEN + b[: cut if cut else None] + close,
                     st.text(max_size=8), body, st.integers(0, 40), st.sampled_from(["", TOOL_CALL_CLOSE, "</tool"]))


@EXAMPLES
@given(st.one_of(noisy_text, tool_call_like()))
def test_parse_action_never_raises_and_types_its_result(text: str) -> None:
    parsed = parse_action(text)
    assert parsed.kind in ("call", "answer", "parse_error")
    if parsed.kind == "call":
        assert isinstance(parsed.call, Call) and isinstance(parsed.call.name, str) and parsed.call.name
        assert isinstance(parsed.call.arguments, dict)
        json.dumps(parsed.call.arguments)  # a call's arguments are JSON
    elif parsed.kind == "parse_error":
        assert isinstance(parsed.error, str) and parsed.error


@EXAMPLES
@given(st.one_of(noisy_text, st.builds(lambda v, cut: RESULT_OPEN + json.dumps(v)[: cut or None] + RESULT_CLOSE,
                                       json_values, st.integers(0, 30))))
def test_parse_result_gives_json_or_an_error(text: str) -> None:
    value, error = parse_result(text)
    if error is None:
        json.dumps(value)
    else:
        assert value is None and isinstance(error, str) and error


python_literals = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3),
    max_leaves=8)
identifiers = st.text(string.ascii_letters + "_", min_size=1, max_size=8)


@EXAMPLES
@given(st.one_of(
    noisy_text,
    st.text(alphabet="()[]{},'\"=_ab0", max_size=60),
    st.builds(lambda name, kw, pos: f"{name}({', '.join([repr(p) for p in pos] + [f'{k}={v!r}' for k, v in kw.items()])})",
              identifiers, st.dictionaries(identifiers, python_literals, max_size=3), st.lists(python_literals, max_size=2)),
    st.integers(1, 5000).map(lambda n: "f(" + "[" * n + "]" * n + ")"),  # deep nesting: the recursion limit
))
def test_gold_call_strings_parse_or_fail_with_a_value_error(text: str) -> None:
    try:
        name, args = parse_call_string(text, param_names=lambda tool: ["a", "b"])
    except ValueError as exc:
        assert str(exc)
        return
    assert isinstance(name, str) and isinstance(args, dict)
    json.dumps(args)


@EXAMPLES
@given(label=st.one_of(st.none(), st.sampled_from(LABELS), st.text(max_size=8)),
       predicted=st.one_of(noisy_text, json_values.map(json.dumps)),
       action=st.one_of(noisy_text, tool_call_like()), note=st.text(max_size=30), annotator=st.text(max_size=30))
def test_corrections_typed_in_annotate_validate_or_say_what_to_fix(label: Any, predicted: str, action: str,
                                                                   note: str, annotator: str) -> None:
    try:
        annotation = build_annotation(1, label, predicted, action, note, annotator)
    except InputError as exc:
        assert str(exc)
        return
    assert isinstance(annotation, Annotation) and annotation.annotator.strip()
    json.dumps(annotation.corrected_predicted)


# ---------------------------------------------------------------- episode JSONL import


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """One real trace line: an episode with a step and an annotation, exported by the product."""
    store = Store(tmp_path_factory.mktemp("fuzz") / "src.db")
    branch = Branch(index=0, action_text='<tool_call>{"name": "ls", "arguments": {}}</tool_call>', kind="call",
                    call=Call(name="ls"), predicted_text="{}", predicted={}, actual={"files": []},
                    actual_source="committed", chosen=True)
    ep = Episode(id="ep-fuzz", task_id=envs.MOCK_TASK_ID, model="embedded", settings=RunSettings(),
                 steps=[Step(index=0, turn=0, branches=[branch], chosen=0, kind="call")])
    store.save_episode(ep)
    store.add_step(ep, ep.steps[0])
    path = tmp_path_factory.mktemp("fuzz") / "out.jsonl"
    export_episodes(store, path)
    return path.read_bytes()


def mutate(value: Any, path: list[int], new: Any) -> Any:
    """`value` with the node picked by `path` (indices into dict items / list items) replaced by `new`."""
    if not path or not isinstance(value, (dict, list)) or not value:
        return new
    i = path[0] % len(value)
    if isinstance(value, dict):
        key = list(value)[i]
        return {**value, key: mutate(value[key], path[1:], new)}
    return value[:i] + [mutate(value[i], path[1:], new)] + value[i + 1:]


@EXAMPLES
@given(data=st.data())
def test_trace_imports_validate_whole_files_and_write_all_or_nothing(exported: bytes, tmp_path_factory: Any,
                                                                    data: st.DataObject) -> None:
    record = json.loads(exported)
    kind = data.draw(st.sampled_from(["mutate", "bytes", "cut"]))
    if kind == "mutate":
        path = data.draw(st.lists(st.integers(0, 50), max_size=6))
        blob = json.dumps(mutate(record, path, data.draw(json_values))).encode()
    elif kind == "bytes":
        blob = data.draw(st.binary(max_size=200))
    else:
        blob = exported[: data.draw(st.integers(0, len(exported)))]
    store = Store(tmp_path_factory.mktemp("fuzz-import") / "dst.db")
    try:
        records = parse_traces(blob)
    except TraceFileError as exc:
        assert str(exc)
        assert store.list_episodes() == []  # validated before anything is written
        return
    result = import_records(store, records)
    assert len(store.list_episodes()) == len(result.imported) == len(records)


# ---------------------------------------------------------------- CLI values and model specs


@EXAMPLES
@given(option=st.sampled_from(["--seed", "--temperature", "--branches", "--max-action-tokens",
                               "--max-rehearsal-tokens", "--max-steps", "--mode", "--selector", "--constrain",
                               "--tool-choice", "--rehearsal-context"]),
       value=st.one_of(st.text(max_size=12), st.integers().map(str), st.floats().map(str)),
       task=st.one_of(st.text(max_size=20), st.just(envs.MOCK_TASK_ID)))
def test_cli_option_values_are_checked_before_anything_runs(option: str, value: str, task: str) -> None:
    try:
        args = cli.build_parser().parse_args(["run", f"--task={task}", f"{option}={value}"])
    except SystemExit as exc:
        assert exc.code == 2  # argparse's own usage error
        return
    try:
        cli.settings_from_args(args)
        common.load_task_or_fail(args.task)
    except common.UserError as exc:
        assert str(exc)


@EXAMPLES
@given(st.one_of(st.text(max_size=30),
                 st.builds(lambda k, t: f"{k}:{t}", st.sampled_from(["hf", "gguf", "openai", "embedded", "x"]),
                           st.text(max_size=30))))
def test_model_specs_parse_or_name_the_valid_forms(spec: str) -> None:
    try:
        parsed = parse_spec(spec)
    except ModelSpecError as exc:
        assert "valid forms" in str(exc)
        return
    assert isinstance(parsed, ModelSpec) and parsed.kind in ("embedded", "hf", "gguf", "openai")


# ---------------------------------------------------------------- the world model's endpoint (MCP tools)

good_property = st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "array",
                                                                "object"])},
                                      optional={"description": st.text(max_size=10)})
property_schemas = st.one_of(
    good_property, good_property,
    st.fixed_dictionaries({"type": st.sampled_from(["null", "int", "dict", "float", "strin"])},
                          optional={"enum": st.lists(json_values, max_size=3), "items": json_values,
                                    "default": json_values}),
    st.booleans(), json_values)
good_schemas = st.builds(lambda props, n: {"type": "object", "properties": props, "required": list(props)[:n]},
                         st.dictionaries(identifiers, good_property, max_size=3), st.integers(0, 2))
input_schemas = st.one_of(
    good_schemas, good_schemas, good_schemas,
    st.builds(lambda props, required, extra: {"type": "object", "properties": props,
                                              **({"required": required} if required is not None else {}), **extra},
              st.one_of(st.dictionaries(identifiers, property_schemas, max_size=4), json_values),
              st.one_of(st.none(), st.lists(identifiers, max_size=3), json_values),
              st.dictionaries(st.sampled_from(["additionalProperties", "$schema", "title", "$ref"]), json_values,
                              max_size=2)),
    json_values)
tool_names = st.sampled_from(["cat", "ls"])
good_tools = st.builds(lambda schema, desc: [{"name": "cat", "description": desc, "inputSchema": schema},
                                             {"name": "ls", "inputSchema": {"type": "object", "properties": {}}}],
                       good_schemas, st.text(max_size=20))
tool_defs = st.one_of(
    st.fixed_dictionaries({"name": st.one_of(tool_names, st.text(max_size=6))},
                          optional={"description": st.text(max_size=20), "inputSchema": input_schemas,
                                    "outputSchema": st.one_of(input_schemas, json_values),
                                    "annotations": st.one_of(json_values, st.just({"readOnlyHint": True}))}),
    st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
              tool_names, input_schemas),
    json_values)
tool_lists = st.one_of(good_tools, good_tools, good_tools, good_tools, st.lists(tool_defs, min_size=1, max_size=2), json_values, noisy_text)
good_messages = st.one_of(
    st.builds(lambda text: {"role": "user", "content": text}, st.text(max_size=20)),
    st.builds(lambda text: {"role": "assistant", "content": text}, st.text(max_size=20)),
    st.builds(lambda name, args: {"role": "assistant", "tool_calls": [{"function": {"name": name, "arguments": args}}]},
              tool_names, st.one_of(st.dictionaries(identifiers, json_values, max_size=2).map(json.dumps), noisy_text)),
    st.builds(lambda v: {"role": "tool", "content": v}, st.one_of(json_values.map(json.dumps), st.text(max_size=10))))
messages = st.one_of(
    good_messages, good_messages, good_messages,
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool", "system", ""]),
                           "content": st.one_of(st.text(max_size=20), json_values)},
                          optional={"tool_calls": json_values}),
    json_values)
histories = st.one_of(st.lists(messages, max_size=3), st.lists(good_messages, max_size=3), json_values)
world_calls = st.one_of(
    st.fixed_dictionaries({"name": tool_names, "arguments": st.dictionaries(identifiers, json_values, max_size=2)}),
    st.fixed_dictionaries({"name": tool_names, "arguments": st.just({})}),
    st.fixed_dictionaries({"name": st.one_of(tool_names, json_values)},
                          optional={"arguments": st.one_of(st.dictionaries(identifiers, json_values, max_size=3),
                                                           json_values, noisy_text)}),
    json_values, noisy_text)


def _world_model() -> Any:
    from app.engine.world_model import WorldModel
    from scripted import ScriptedPolicy

    call = '<tool_call>{"name": "cat", "arguments": {"file_name": "a"}}</tool_call>'
    return WorldModel(ScriptedPolicy([[call, "Done."]] * 4))


WORLD_EXAMPLES = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@WORLD_EXAMPLES
@given(tools=tool_lists, history=histories, call=world_calls)
def test_rehearse_inputs_give_a_rehearsal_or_say_what_to_fix(tools: Any, history: Any, call: Any) -> None:
    from app.engine.world_model import Rehearsal, WorldModelInputError

    try:
        out = _world_model().rehearse(tools, history, call)
    except WorldModelInputError as exc:
        assert str(exc).strip() and "\n" not in str(exc)
        event("refused")
        return
    event("rehearsed")
    assert isinstance(out, Rehearsal) and isinstance(out.call["name"], str) and isinstance(out.call["arguments"], dict)
    json.dumps(out.call)


@WORLD_EXAMPLES
@given(tools=tool_lists, history=histories,
       k=st.one_of(st.integers(1, 4), st.integers(1, 4), st.integers(-1, 10), st.floats(allow_nan=False),
                 st.text(max_size=3), st.booleans()))
def test_propose_inputs_give_candidates_or_say_what_to_fix(tools: Any, history: Any, k: Any) -> None:
    from app.engine.world_model import Candidate, WorldModelInputError

    try:
        out = _world_model().propose(tools, history, k)
    except WorldModelInputError as exc:
        assert str(exc).strip() and "\n" not in str(exc)
        event("refused")
        return
    event("proposed")
    assert out and all(isinstance(c, Candidate) for c in out) and sum(c.chosen for c in out) == 1
