"""Schema-constrained Act and Rehearse: the grammars admit what the expert writes, constrained
outputs are schema-valid, a grammar that cannot be built falls back, decoding stays deterministic
and batch-independent.
"""
from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

import jsonschema
import pytest

from app import envs
from app.envs.base import Tool
from app.formats import (ACT_MAX_STRING, ACT_STOP, REHEARSE_STOP, TOOL_CALL_OPEN, HistoryItem, act_constraint, act_prompt,
                         call_text, grammar_schema, parse_action, parse_result, rehearse_constraint,
                         rehearse_prompt, rehearse_target)
from app.records import Call
from app.training.rows import expert_episode
from model_backend.base import Constraint, GenerationConfig, Prompt
from model_backend.loops import repeated_phrase

HELDOUT = envs.list_tasks("multi_turn_base", "heldout")
TRAIN = envs.list_tasks("multi_turn_base", "train")


def expert_calls(task_ids: list[str]) -> list[tuple[list[Tool], Call, Any]]:
    """(tools available at the step, the expert's call, its real response) for every expert call."""
    out = []
    for task_id in task_ids:
        task = envs.load_task(task_id)
        env = envs.make_env(task)
        for step in expert_episode(task).steps:
            b = step.chosen_branch
            if b.kind == "call":
                env.set_turn(step.turn)
                out.append((env.tools(), b.call, b.actual))
    return out


# ---------------------------------------------------------------- schemas (no model)


def test_grammar_schema_keeps_types_and_enums_and_drops_text() -> None:
    schema = {"type": "object", "properties": {
        "door": {"type": "array", "items": {"type": "string"},
                 "description": 'Doors. [Enum]: ["driver", "passenger"]'},
        "unit": {"type": "string", "description": 'Unit. [Enum]: ["lines", "words"]', "default": "lines"},
        "n": {"type": "integer", "description": "How many."}}, "required": ["door"]}
    out = grammar_schema(schema, closed=True)
    assert out == {"type": "object", "required": ["door"], "additionalProperties": False, "properties": {
        "door": {"type": "array", "items": {"type": "string", "enum": ["driver", "passenger"]}},
        "unit": {"type": "string", "enum": ["lines", "words"]},
        "n": {"type": "integer"}}}
    assert "additionalProperties" not in grammar_schema(schema, closed=False)


def test_act_constraint_required_and_auto() -> None:
    tools = envs.make_env(envs.load_task(HELDOUT[0])).tools()
    auto = act_constraint(tools)
    required = act_constraint(tools, prefill=TOOL_CALL_OPEN)
    assert auto.allow_text and auto.open == TOOL_CALL_OPEN and auto.close == "</tool_call>"
    assert not required.allow_text and required.open == ""
    assert len(auto.schema["anyOf"]) == len(tools)
    assert act_constraint([]) is None


def test_every_expert_call_and_no_wrong_call_fits_the_call_schema() -> None:
    calls = expert_calls(TRAIN[:40])
    assert len(calls) > 150
    misfits = []
    for tools, call, _ in calls:
        body = json.loads(call_text(call).removeprefix(TOOL_CALL_OPEN).removesuffix("</tool_call>"))
        schema = act_constraint(tools).schema
        if not jsonschema.Draft7Validator(schema).is_valid(body):
            misfits.append(call)
        # The same call with an unknown argument, or to an unknown tool, never fits.
        assert not jsonschema.Draft7Validator(schema).is_valid({**body, "name": "rm_rf_everything"})
        assert not jsonschema.Draft7Validator(schema).is_valid(
            {**body, "arguments": {**body["arguments"], "no_such_argument": 1}})
    # Only calls carrying a free-text string longer than the cap (file contents) do not fit.
    assert all(longest_string(c.arguments) > ACT_MAX_STRING for c in misfits)
    assert len(misfits) <= 0.02 * len(calls)


def longest_string(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return max((longest_string(v) for v in items), default=0)


def test_prompts_carry_the_constraint_only_when_asked() -> None:
    tools = envs.make_env(envs.load_task(HELDOUT[0])).tools()
    history = [HistoryItem(role="user", content="list the files")]
    plain = act_prompt(tools, history, len, 8192)
    constrained = act_prompt(tools, history, len, 8192, constrain=True)
    assert plain.constraint is None and constrained.constraint is not None
    assert plain.messages == constrained.messages  # training and inference read the same text
    call = Call(name="ls", arguments={"a": True})
    tool = next(t for t in tools if t.name == "ls")
    assert rehearse_prompt(tool, call, history, constrain=True).constraint == rehearse_constraint(tool)
    assert rehearse_prompt(tool, call, history).constraint is None


# ---------------------------------------------------------------- grammars on the real tokenizer


CALL_SCHEMA_KEYS = {"type": "object", "properties": {"name": {"const": "get"}, "arguments": {
    "type": "object", "properties": {"key": {"type": "string", "maxLength": 8}, "n": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"enum": ["x", 1]}}},
    "required": ["key"], "additionalProperties": False}}, "required": ["name", "arguments"],
    "additionalProperties": False}
RESPONSE_SCHEMA = {"anyOf": [{"type": "object", "properties": {"value": {"type": "string"}}},
                             {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"],
                              "additionalProperties": False}, {"type": "null"}]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from model_backend.loading import load_tokenizer

    return load_tokenizer("embedded")[0]


def admits(tokenizer: Any, constraint: Constraint, text: str) -> bool:
    from model_backend.constrain import RowMatcher

    matcher = RowMatcher(tokenizer, constraint)
    return all(matcher.consume(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.accepting


_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[a-z][a-z0-9-]*|::=|[()|?*+]|\{\d+(?:,\d+)?\}|\n|[ \t]+')


def gbnf_as_lark(gbnf: str) -> str:
    """The GBNF as a Lark grammar of single-character lexemes, read by llguidance's Earley parser: a
    character-level reading, as llama.cpp's own (llguidance's `gbnf_to_lark` makes terminals of the non-recursive
    rules, and its greedy lexer then rejects texts llama.cpp admits, e.g. a key that starts like a listed one)."""
    out, pos = [], 0
    while pos < len(gbnf):
        m = _GBNF_TOKEN.match(gbnf, pos)
        assert m, f"unreadable GBNF at {gbnf[pos:pos + 20]!r}"
        tok, pos = m.group(), m.end()
        if tok.startswith('"'):
            chars = json.loads(tok.replace("\\x", "\\u00"))
            out.append(" ".join(json.dumps(ch) for ch in chars))
        elif tok.startswith("["):
            out.append("/" + tok.replace("/", "\\/") + "/")
        elif tok == "::=":
            out.append(":")
        elif tok[0].isalpha():
            out.append("start" if tok == "root" else tok.replace("-", "_"))
        else:
            out.append(tok)
    return "".join(out)


def admits_gbnf(tokenizer: Any, constraint: Constraint, text: str) -> bool:
    """The GBNF the HTTP path sends llama.cpp (`gbnf_text`), read character by character as llama.cpp reads it."""
    import llguidance

    from model_backend.constrain import _ll_tokenizer
    from model_backend.grammars import gbnf_text

    matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer), gbnf_as_lark(gbnf_text(constraint)), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


GBNF_CASES = [  # (constraint, text, admitted): each feature `grammar_schema` keeps, in and out
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"), '{"name": "get", "arguments": {"key": "a"}}</tool_call>',
     True),
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"),
     '{"name": "get", "arguments": {"key": "a", "n": -3, "tags": ["x", 1]}}</tool_call>', True),
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"), '{"name": "get", "arguments": {"n": 3}}</tool_call>',
     False),  # the required key is missing
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"),
     '{"name": "get", "arguments": {"n": 3, "key": "a"}}</tool_call>', False),  # not in the schema's order
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"),
     '{"name": "put", "arguments": {"key": "a"}}</tool_call>', False),  # const
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"),
     '{"name": "get", "arguments": {"key": "a", "other": 1}}</tool_call>', False),  # additionalProperties false
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"),
     '{"name": "get", "arguments": {"key": "abcdefghi"}}</tool_call>', False),  # maxLength 8
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"),
     '{"name": "get", "arguments": {"key": "a", "tags": ["y"]}}</tool_call>', False),  # enum of the items
    (Constraint(schema=CALL_SCHEMA_KEYS, close="</tool_call>"), '{"name":"get","arguments":{"key":"a"}}</tool_call>',
     False),  # json.dumps's separators, as the local decoder writes them
    (Constraint(schema=CALL_SCHEMA_KEYS, open="<tool_call>", close="</tool_call>", allow_text=True),
     "The answer is 4.", True),
    (Constraint(schema=CALL_SCHEMA_KEYS, open="<tool_call>", close="</tool_call>", allow_text=True),
     '<tool_call>{"name": "get", "arguments": {"key": "a"}}</tool_call>', True),
    (Constraint(schema=CALL_SCHEMA_KEYS, open="<tool_call>", close="</tool_call>", allow_text=True),
     "Sure <tool_call>", False),  # text may not hold a call
    (Constraint(schema=RESPONSE_SCHEMA, close="</execution_result>"),
     '{"value": "blue", "extra": [1, {"a": null}]}</execution_result>', True),  # open object: more keys allowed
    (Constraint(schema=RESPONSE_SCHEMA, close="</execution_result>"), '{"error": "no such key"}</execution_result>',
     True),
    (Constraint(schema=RESPONSE_SCHEMA, close="</execution_result>"), "null</execution_result>", True),
    (Constraint(schema=RESPONSE_SCHEMA, close="</execution_result>"), '{"value": 3}</execution_result>', False),
    (Constraint(schema=RESPONSE_SCHEMA, close="</execution_result>"), '{"valu": 3, "values": 4, "": 5}</execution_result>',
     True),  # further keys: any but the listed ones
    (Constraint(schema=RESPONSE_SCHEMA, close="</execution_result>"), '{"error": "x", "value": 3}</execution_result>',
     False),
    (Constraint(schema={}, close="</execution_result>"), '[1.5e3, "x", true, {}]</execution_result>', True),
]


@pytest.mark.parametrize("case", range(len(GBNF_CASES)))
def test_the_gbnf_says_what_the_lark_grammar_says(tokenizer: Any, case: int) -> None:
    constraint, text, admitted = GBNF_CASES[case]
    assert admits_gbnf(tokenizer, constraint, text) is admitted
    assert admits(tokenizer, constraint, text) is admitted  # the local decoder's grammar agrees


@pytest.mark.slow
def test_the_grammars_admit_the_expert_token_for_token(tokenizer: Any) -> None:
    calls = expert_calls(TRAIN[:24])
    short = [(tools, call, actual) for tools, call, actual in calls if longest_string(call.arguments) <= ACT_MAX_STRING]
    assert len(short) >= 0.98 * len(calls)
    act_ok = sum(admits(tokenizer, act_constraint(tools), call_text(call)) for tools, call, _ in short)
    rehearse_ok = sum(admits(tokenizer, rehearse_constraint(next(t for t in tools if t.name == call.name)),
                             rehearse_target(actual)) for tools, call, actual in calls)
    print(f"admitted: act {act_ok}/{len(short)}, rehearse {rehearse_ok}/{len(calls)}")
    assert act_ok == len(short)
    # The GBNF llama.cpp gets admits the same calls and responses (every tool's real schemas).
    assert all(admits_gbnf(tokenizer, act_constraint(tools), call_text(call)) for tools, call, _ in short)
    assert [admits_gbnf(tokenizer, rehearse_constraint(next(t for t in tools if t.name == call.name)),
                        rehearse_target(actual)) for tools, call, actual in calls] == \
        [admits(tokenizer, rehearse_constraint(next(t for t in tools if t.name == call.name)), rehearse_target(actual))
         for tools, call, actual in calls]
    # BFCL's response docs contradict a few real responses (e.g. send_message's message_id is an object).
    assert rehearse_ok >= 0.9 * len(calls)
    assert not admits(tokenizer, act_constraint(calls[0][0]), '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    # A looping string argument is cut off by the grammar: past the cap only the closing quote fits.
    tools = envs.make_env(envs.load_task(HELDOUT[0])).tools()
    echo = Call(name="echo", arguments={"content": "na " * 100})
    assert admits(tokenizer, act_constraint(tools), call_text(Call(name="echo", arguments={"content": "na " * 50})))
    assert not admits(tokenizer, act_constraint(tools), call_text(echo))


@pytest.mark.slow
def test_an_unbuildable_grammar_falls_back_with_a_warning(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    from model_backend.constrain import ConstraintError, RowMatcher, matcher_for

    bad = Constraint(schema={"type": "no-such-type"}, close="</tool_call>")
    with pytest.raises(ConstraintError):
        RowMatcher(tokenizer, bad)
    with caplog.at_level(logging.WARNING, logger="model_backend.constrain"):
        assert matcher_for(tokenizer, bad) is None
    assert "cannot be built" in caplog.text


@pytest.mark.slow
def test_a_rehearsal_string_that_loops_or_nears_the_budget_is_closed(tokenizer: Any) -> None:
    from model_backend.constrain import CLOSE_MARGIN, RowMatcher

    constraint = rehearse_constraint(None)
    assert constraint.close_strings

    def fed(text: str) -> RowMatcher:
        m = RowMatcher(tokenizer, constraint)
        assert all(m.consume(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return m

    def only_closers(m: RowMatcher) -> bool:
        allowed = m.allowed(len(tokenizer)).nonzero().flatten().tolist()
        return all(set(tok) <= set('"}]') for tok in tokenizer.convert_ids_to_tokens(allowed))

    # Closed at the fourth repeat, so the closed string never counts as a loop (more than four).
    text = '{"error": "mkdir: No such dir: No such user: No such group: No such'
    looping = fed(text)
    assert only_closers(looping) and looping.closed == 1
    assert repeated_phrase(text) is None and repeated_phrase(text + " file: No such") == "no such"
    assert not only_closers(fed('{"error": "mkdir: No such dir: No such user: No such'))  # three: not yet
    near = fed('{"error": "mkdir: cannot')
    assert not only_closers(near)
    near.consumed, near.budget = 100, 100 + CLOSE_MARGIN  # as many tokens left as closing may need
    assert only_closers(near)
    # A tight budget closes at a quarter of it, not CLOSE_MARGIN before it: 26 tokens keep 20 for the value (the
    # fine-tune's measurement budgets are this tight; 16 before 26 cut "deep_folder" to "deep_").
    near.budget, near.consumed = 26, 19
    assert not only_closers(near)
    near.consumed = 20
    assert only_closers(near)
    # Without the flag (Act's constraint) nothing is closed early.
    free = RowMatcher(tokenizer, Constraint(schema={}, close="</x>"))
    assert all(free.consume(t) for t in tokenizer.encode('{"e": "No such a: No such b: No such c: No such d: No such',
                                                            add_special_tokens=False))
    assert not only_closers(free)


# ---------------------------------------------------------------- decoding with the shipped agent


def first_prompts(shipped_policy: Any, n: int, prefill: str = "") -> list[tuple[list[Tool], Prompt]]:
    out = []
    for task_id in HELDOUT[:n]:
        task = envs.load_task(task_id)
        tools = envs.make_env(task).tools()
        history = [HistoryItem(role="user", content=m["content"]) for m in task.turns[0]]
        out.append((tools, act_prompt(tools, history, shipped_policy.count_tokens, shipped_policy.context_window,
                                      prefill=prefill, constrain=True)))
    return out


def assert_valid_call(text: str, tools: list[Tool]) -> None:
    action = parse_action(text)
    assert action.kind == "call", text
    tool = {t.name: t for t in tools}.get(action.call.name)
    assert tool is not None, text
    jsonschema.validate(action.call.arguments, {**tool.parameters, "additionalProperties": False})


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 7])
def test_constrained_calls_parse_name_a_tool_and_validate(shipped_policy: Any, seed: int) -> None:
    config = GenerationConfig(max_new_tokens=96, temperature=1.0, seed=seed, stop=ACT_STOP)
    for tools, prompt in first_prompts(shipped_policy, 3, prefill=TOOL_CALL_OPEN):
        gens = shipped_policy.act(prompt, 3, config)
        for gen in gens:
            if gen.finished:  # a row cut by the token budget is unfinished JSON, reported as such
                assert_valid_call(gen.text, tools)
        assert gens[0].finished
    for tools, prompt in first_prompts(shipped_policy, 2):  # tool_choice auto: a valid call or a plain answer
        for gen in shipped_policy.act(prompt, 3, config):
            action = parse_action(gen.text)
            if action.kind != "answer" and gen.finished:
                assert_valid_call(gen.text, tools)
            assert action.kind != "answer" or not action.answer.startswith(("<", "{"))


@pytest.mark.slow
def test_constrained_rehearsals_are_json_of_the_response_schema(shipped_policy: Any) -> None:
    calls = expert_calls(HELDOUT[:2])[:6]
    prompts = [rehearse_prompt(next(t for t in tools if t.name == call.name), call, [], constrain=True)
               for tools, call, _ in calls]
    config = GenerationConfig(max_new_tokens=128, temperature=0.0, stop=REHEARSE_STOP)
    for (tools, call, _), prompt, gen in zip(calls, prompts, shipped_policy.rehearse(prompts, config)):
        predicted, error = parse_result(gen.text)
        assert error is None, gen.text  # finished or not: the value is closed before the budget runs out
        assert jsonschema.Draft7Validator(prompt.constraint.schema).is_valid(predicted), gen.text
    # A budget far too small for most responses still ends every prediction as complete JSON.
    tight = GenerationConfig(max_new_tokens=20, temperature=0.0, stop=REHEARSE_STOP)
    for gen in shipped_policy.rehearse(prompts, tight):
        assert parse_result(gen.text)[1] is None, gen.text


@pytest.mark.slow
def test_constrained_decoding_is_deterministic_and_batch_independent(shipped_policy: Any) -> None:
    from model_backend.decoding import Row, generate

    config = GenerationConfig(max_new_tokens=48, temperature=0.9, seed=3, stop=ACT_STOP)
    (tools, prompt), *rest = first_prompts(shipped_policy, 3)
    first = [g.text for g in shipped_policy.act(prompt, 3, config)]
    assert first == [g.text for g in shipped_policy.act(prompt, 3, config)]
    # Greedy rows of different prompts: batched together == each alone.
    prompts = [prompt] + [p for _, p in rest]
    rows = lambda: [Row(shipped_policy.encode(p), stop=ACT_STOP, matcher=shipped_policy._matcher(p)) for p in prompts]  # noqa: E731
    batched = generate(shipped_policy.model, shipped_policy.tokenizer, rows(), 48, shipped_policy.eos_ids, shipped_policy.pad_id)
    alone = [generate(shipped_policy.model, shipped_policy.tokenizer, [row], 48, shipped_policy.eos_ids, shipped_policy.pad_id)[0]
             for row in rows()]
    assert [o.text for o in batched] == [o.text for o in alone]
    assert batched[0].text == first[0]


def test_settings_stored_before_constrain_existed_read_as_unconstrained() -> None:
    from app.records import Episode, RunSettings

    old = RunSettings().model_dump()
    del old["constrain"]
    assert RunSettings.from_stored(old).constrain is False
    assert RunSettings().constrain is True and RunSettings.from_stored(RunSettings().model_dump()).constrain
    ep = Episode.model_validate({"id": "e", "task_id": "mock:kv", "model": "m", "settings": old})
    assert ep.settings.constrain is False


@pytest.mark.slow
def test_jump_forward_takes_forced_tokens_in_fewer_steps(shipped_policy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens the grammar forces are fed in one forward instead of one decode step each: the same greedy
    text (batched, rows of different prompts), one log-probability per token as the model gives it, and
    fewer decode steps."""
    from model_backend import decoding
    from model_backend.decoding import Row, generate

    steps = {"n": 0}
    real_step = decoding.decode_step

    def counting(model: Any, cache: Any) -> Any:
        step = real_step(model, cache)

        def counted(*args: Any, **kwargs: Any) -> Any:
            steps["n"] += 1
            return step(*args, **kwargs)

        return counted

    monkeypatch.setattr(decoding, "decode_step", counting)
    prompts = [p for _, p in first_prompts(shipped_policy, 3)]
    rows = lambda: [Row(shipped_policy.encode(p), stop=ACT_STOP, matcher=shipped_policy._matcher(p)) for p in prompts]  # noqa: E731
    outs, counts = {}, {}
    for jump in (False, True):
        steps["n"] = 0
        outs[jump] = generate(shipped_policy.model, shipped_policy.tokenizer, rows(), 64, shipped_policy.eos_ids, shipped_policy.pad_id,
                              jump_forward=jump)
        counts[jump] = steps["n"]
    assert [o.text for o in outs[True]] == [o.text for o in outs[False]]
    assert all(o.text.endswith("</tool_call>") for o in outs[True]), [o.text for o in outs[True]]
    for fast, slow in zip(outs[True], outs[False]):
        assert len(fast.token_logprobs) == len(fast.token_ids)  # ended by the stop string, not EOS
        if fast.token_ids == slow.token_ids:  # the same tokens: the same log-probabilities, to rounding
            assert fast.token_logprobs == pytest.approx(slow.token_logprobs, abs=1e-3)
    assert counts[True] < counts[False] / 1.5, counts


@pytest.mark.slow
def test_jump_forward_keeps_sampled_candidates(shipped_policy: Any) -> None:
    """Sampled rows jump forward too, and their seeded generators skip one draw per forced token, so the K
    candidates of one prompt come out as they do without jump-forward: as many distinct texts, the same ones."""
    from model_backend.decoding import Row, generate

    prompt = first_prompts(shipped_policy, 1)[0][1]
    ids = shipped_policy.encode(prompt)

    def rows() -> list[Row]:
        return [Row(ids, stop=ACT_STOP, matcher=shipped_policy._matcher(prompt))] + [
            Row(ids, temperature=1.0, top_p=1.0, seed=seed, stop=ACT_STOP, matcher=shipped_policy._matcher(prompt))
            for seed in (11, 12, 13)]

    texts = {jump: [o.text for o in generate(shipped_policy.model, shipped_policy.tokenizer, rows(), 64, shipped_policy.eos_ids,
                                             shipped_policy.pad_id, jump_forward=jump)]
             for jump in (False, True)}
    assert texts[True] == texts[False]
    assert len(set(texts[True])) > 1, texts[True]


@pytest.mark.parametrize("cheap", [True, False], ids=["uniforms", "fallback"])
def test_skipping_draws_leaves_the_generator_as_real_draws_do(cheap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_skip_draws` past n forced tokens leaves a seeded generator where n one-sample draws over the vocabulary
    leave it, on torch's cheap path (the uniforms alone) and on the fallback (real draws), so the next sampled
    token is the same either way."""
    import torch

    from model_backend import decoding

    vocab = 49_152
    if not cheap:
        monkeypatch.setattr(decoding, "_draw_is_uniforms", lambda vocab_size: False)
    else:
        assert decoding._draw_is_uniforms(vocab), "this torch draws differently: the cheap path is never taken"
    probs = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(1)), dim=-1)
    for n in (0, 1, 7):
        drawn, skipped = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        one_hot = torch.zeros(vocab)
        one_hot[3] = 1.0
        for _ in range(n):
            assert torch.multinomial(one_hot, 1, generator=drawn).item() == 3
        decoding._skip_draws(skipped, vocab, n)
        assert torch.equal(drawn.get_state(), skipped.get_state()), n
        assert (torch.multinomial(probs, 1, generator=drawn).item()
                == torch.multinomial(probs, 1, generator=skipped).item())


@pytest.mark.slow
def test_tool_alternatives_are_valid_calls_of_distinct_tools(shipped_policy: Any) -> None:
    """`proposal=tools` on the real model: K candidates that name K distinct tools, the alternatives in the
    order `rank_tools` gives, each schema-valid for its tool."""
    from app.engine.proposals import propose, rank_tools

    config = GenerationConfig(max_new_tokens=96, temperature=0.8, seed=0, stop=ACT_STOP)
    for tools, prompt in first_prompts(shipped_policy, 2, prefill=TOOL_CALL_OPEN):
        gens, log_p = propose(shipped_policy, prompt, tools, 4, config, "tools")
        assert log_p == {}  # no relevance weight: the tools are ranked but no branch carries a tool score
        for gen in gens:
            assert_valid_call(gen.text, tools)
        names = [parse_action(g.text).call.name for g in gens]
        assert len(names) == 4 and len(set(names)) == 4, names
        ranked = [r.tool.name for r in rank_tools(shipped_policy, prompt, tools)]
        assert names[1:] == [n for n in ranked if n != names[0]][:3]


@pytest.mark.slow
def test_relevance_re_aims_the_primary_at_the_top_ranked_tool(shipped_policy: Any) -> None:
    """With `relevance` on the real model: one finite log P(request | tool) per tool, and the primary is a
    schema-valid call to the tool that ranks first by direct + weight * relevance."""
    from app.engine.proposals import propose, rank_tools, relevance

    config = GenerationConfig(max_new_tokens=96, temperature=0.0, seed=0, stop=ACT_STOP)
    tools, prompt = first_prompts(shipped_policy, 1, prefill=TOOL_CALL_OPEN)[0]
    request = prompt.messages[-1]["content"]
    rel = relevance(shipped_policy, request, tools)
    assert sorted(rel) == sorted(t.name for t in tools)
    assert all(math.isfinite(v) and v < 0 for v in rel.values())
    ranked = rank_tools(shipped_policy, prompt, tools, rel, 0.5)
    assert [r.score for r in ranked] == sorted((r.score for r in ranked), reverse=True)
    assert sum(math.exp(r.log_p) for r in ranked) == pytest.approx(1.0)
    gens, log_p = propose(shipped_policy, prompt, tools, 1, config, "sample", rel, 0.5)
    assert_valid_call(gens[0].text, tools)
    assert parse_action(gens[0].text).call.name == ranked[0].tool.name
    assert log_p == {r.tool.name: r.log_p - ranked[0].log_p for r in ranked}
    assert log_p[ranked[0].tool.name] == 0.0 and all(v <= 0 for v in log_p.values())


def test_a_stop_string_inside_a_constrained_value_does_not_end_the_row(tokenizer) -> None:
    """A Rehearse value may quote the close tag (`"...</execution_result>..."`): the row stops only where the grammar
    is complete, and its text is cut after the last stop string, so the prediction stays valid JSON (before, the
    text was cut inside the string: `{"a": "x</execution_result>`)."""
    from app.formats import RESULT_CLOSE, rehearse_constraint
    from model_backend.constrain import RowMatcher
    from model_backend.decoding import _cut_at_stop, _hit_stop

    inside, rest = '{"note": "x' + RESULT_CLOSE, '"}' + RESULT_CLOSE
    matcher = RowMatcher(tokenizer, rehearse_constraint(None))
    ids = tokenizer.encode(inside, add_special_tokens=False)
    assert all(matcher.consume(t) for t in ids)
    window = len(RESULT_CLOSE.encode()) + 2
    assert not _hit_stop(tokenizer, ids, (RESULT_CLOSE,), window, matcher)  # inside the string: go on
    assert _hit_stop(tokenizer, ids, (RESULT_CLOSE,), window)  # unconstrained rows stop at the text, as before
    more = tokenizer.encode(rest, add_special_tokens=False)
    assert all(matcher.consume(t) for t in more) and matcher.accepting
    assert _hit_stop(tokenizer, ids + more, (RESULT_CLOSE,), window, matcher)
    text = tokenizer.decode(ids + more)
    assert _cut_at_stop(text, (RESULT_CLOSE,), constrained=True) == inside + rest
    assert json.loads(_cut_at_stop(text, (RESULT_CLOSE,), constrained=True).removesuffix(RESULT_CLOSE)) == \
        {"note": "x" + RESULT_CLOSE}


def test_closing_inside_a_string_closes_the_string_first(tokenizer) -> None:
    """Near the budget a Rehearse row may write only closing tokens; inside a string those must start with `"`
    (a `}` there is text, and a row once wrote `}` until its budget ran out, leaving the string open)."""
    from app.formats import rehearse_constraint
    from model_backend.constrain import RowMatcher

    matcher = RowMatcher(tokenizer, rehearse_constraint(None))
    for t in tokenizer.encode('{"data": {"k": "text', add_special_tokens=False):
        assert matcher.consume(t)
    matcher.budget = matcher.consumed + 2  # inside the closing margin
    allowed = matcher.allowed(len(tokenizer))
    texts = tokenizer.convert_ids_to_tokens(allowed.nonzero().flatten().tolist())
    assert texts and all(t.startswith('"') and set(t) <= set('"}]') for t in texts), texts[:10]
    assert matcher.consume(tokenizer.convert_tokens_to_ids('"'))
    outside = tokenizer.convert_ids_to_tokens(matcher.allowed(len(tokenizer)).nonzero().flatten().tolist())
    assert any(t.startswith("}") for t in outside)  # outside a string, `}` closes the objects
    assert all(set(t) <= set('"}]') for t in outside)


def test_a_rehearsal_may_close_a_response_before_its_required_fields(tokenizer) -> None:
    """tau2's response schemas mark every field required: near its budget a rehearsal of `get_user_details` could
    not close `address` before writing `city`, `country`, `state` and `zip`, and was cut open. A response grammar
    requires no field (an argument grammar still does)."""
    from app.envs.base import Tool
    from app.formats import act_constraint, rehearse_constraint
    from model_backend.constrain import RowMatcher

    response = {"type": "object", "required": ["address1", "city", "zip"],
                "properties": {"address1": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}}}
    tool = Tool("get_address", "an address", dict(response), response=response)
    matcher = RowMatcher(tokenizer, rehearse_constraint(tool))
    for t in tokenizer.encode('{"address1": "456 Oakwood Avenue"', add_special_tokens=False):
        assert matcher.consume(t)
    matcher.budget = matcher.consumed + 2
    allowed = tokenizer.convert_ids_to_tokens(matcher.allowed(len(tokenizer)).nonzero().flatten().tolist())
    assert "}" in allowed and all(set(t) <= set('"}]') for t in allowed)
    assert matcher.consume(tokenizer.convert_tokens_to_ids("}"))
    # The call's arguments keep their required fields: `}` after one of three is no call.
    act = RowMatcher(tokenizer, act_constraint([tool], "<tool_call>"))
    for t in tokenizer.encode('{"name": "get_address", "arguments": {"address1": "x"', add_special_tokens=False):
        assert act.consume(t)
    assert not act.consume(tokenizer.convert_tokens_to_ids("}"))


@pytest.mark.parametrize("text", ['{"user": {"address": {"city": "Denver", "state',
                                  '{"reservation": {"flights": [], "insurance":',
                                  '{"reservation": {"flights": [{"id": 3}], "total"'])
def test_near_the_budget_a_value_cut_after_a_key_still_closes(tokenizer, text: str) -> None:
    """tau2 records have no response schema: a rehearsal cut after a key (where no closer is allowed) wrote new
    keys until the budget ran out. Closing now allows only `:`, a short value and the closers there; whichever of
    the allowed tokens a row takes (here always the lowest id, then the highest), it is complete JSON in a few."""
    from app.formats import RESULT_CLOSE, parse_result, rehearse_constraint
    from model_backend.constrain import RowMatcher

    for pick in (min, max):
        matcher = RowMatcher(tokenizer, rehearse_constraint(None))
        for t in tokenizer.encode(text, add_special_tokens=False):
            assert matcher.consume(t)
        matcher.budget = matcher.consumed + 2  # inside the closing margin
        written = ""
        for _ in range(16):
            if matcher.accepting:
                break
            allowed = matcher.allowed(len(tokenizer)).nonzero().flatten().tolist()
            if parse_result(text + written)[1] is not None:  # the value is still open (then the close tag)
                texts = tokenizer.convert_ids_to_tokens(allowed)
                assert all(set(t) <= set('"}]:') or t.lstrip("\u0120") in {"null", "0", "true", "false"}
                           for t in texts), (text + written, [t for t in texts if not set(t) <= set('"}]:')][:8])
            token = pick(allowed)
            assert matcher.consume(token)
            written += tokenizer.decode([token])
            if written.endswith(RESULT_CLOSE):
                break
        value, error = parse_result(text + written)
        assert error is None and isinstance(value, dict), (pick.__name__, written)


@pytest.mark.parametrize("text, value", [
    ('{"note": "x</execution_result>"}</execution_result>', {"note": "x</execution_result>"}),
    ('{"a": 1}</execution_result>', {"a": 1}),
    ('{"a": "open</execution_result>', None),  # still an open string: invalid, as before
])
def test_a_prediction_quoting_the_close_tag_parses_whole(text, value) -> None:
    from app.formats import parse_result

    parsed, error = parse_result(text)
    assert parsed == value and (error is None) == (value is not None)
