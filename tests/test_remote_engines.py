"""Each serving engine's answer shapes, replayed through the fake server (`engine_answers` names the source of each).

What the inspector reads from them: the generated tokens' log-probabilities (the logprob selector), the
prompt's (`score`: tool relevance, the judge, surprise), and which requests an engine refuses for good.
"""
from __future__ import annotations

import json

import pytest
from engine_answers import (LLAMA_CPP_NO_ECHO, LLAMA_CPP_ONE_CHOICE, LLAMA_CPP_PYTHON_NO_LOGITS, generation,
                            llama_cpp_new_echo, llama_cpp_python_echo, logprob, pieces, sglang_echo, vllm_echo)
from fake_openai import FakeOpenAIServer, serving

import model_backend
from model_backend.base import Constraint, GenerationConfig, Prompt, RemoteCapabilityError
from model_backend.grammars import gbnf_text, grammar_text
from model_backend.spec import CONSTRAIN_FORMS

OPTS = "?retries=3&backoff=0.01&timeout=10&tokenizer=embedded"
CFG = GenerationConfig(max_new_tokens=16, stop=("</tool_call>",))
PROMPT = Prompt(messages=[{"role": "system", "content": "You are an assistant."},
                          {"role": "user", "content": "Store blue under color."}])
CONTINUATION = ' {"ok": true, "value": "blue"}'
CALL = '<tool_call>{"name": "get", "arguments": {}}</tool_call>'


def remote(url: str):
    return model_backend.load_policy(f"openai:{url}#fake{OPTS}")


def expected_scores(policy, continuation: str, bos: str = "") -> list[float]:
    """Token i's logprob is -(i+1)/10: the continuation's tokens come after the BOS and the prefix's pieces."""
    before = (1 if bos else 0) + len(pieces(policy.render(PROMPT)))
    return [logprob(before + j) for j in range(len(pieces(continuation)))]


@pytest.mark.parametrize("engine, answer, bos", [
    ("vllm", vllm_echo, ""),
    ("vllm, a model with BOS", vllm_echo, "<|begin_of_text|>"),
    ("sglang", sglang_echo, ""),
    ("sglang, a model with BOS", sglang_echo, "<s>"),
    ("llama-cpp-python", lambda prompt, cont, bos: llama_cpp_python_echo(prompt, cont), ""),
])
def test_prompt_logprobs_of_each_engine(engine: str, answer, bos: str) -> None:
    def post(path: str, body: dict) -> tuple[int, object]:
        assert path.endswith("/completions") and body["echo"] is True and body["max_tokens"] == 1
        prompt = body["prompt"]
        cont = CONTINUATION if prompt.endswith(CONTINUATION) else prompt[-6:]  # the capability probe's text
        return 200, answer(prompt, cont, bos)

    with FakeOpenAIServer(serving("fake", post)) as fake:
        policy = remote(fake.url)
        assert policy.supports_scoring, engine
        [scores] = policy.score([PROMPT], [CONTINUATION])
    assert scores == pytest.approx(expected_scores(policy, CONTINUATION, bos)), engine


@pytest.mark.parametrize("engine, reply", [
    ("llama.cpp: echo refused", LLAMA_CPP_NO_ECHO),
    ("llama.cpp: echo taken, only the generated token's logprobs", None),
])
def test_llama_cpp_server_gives_no_prompt_logprobs_at_once(engine: str, reply) -> None:
    with FakeOpenAIServer(serving("fake", lambda p, b: reply or (200, llama_cpp_new_echo(b["prompt"])))) as fake:
        policy = remote(fake.url)
        assert policy.supports_scoring is False, engine
        with pytest.raises(RemoteCapabilityError, match="no prompt logprobs"):
            policy.score([PROMPT], [CONTINUATION])
        assert len(fake.posts("/completions")) == 1  # one probe, no retries of a refusal; score then asks nothing


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llama.cpp", "llama-cpp-python"])
def test_generated_logprobs_of_each_engine(engine: str) -> None:
    values = [-0.1, -0.2, -0.3, -0.4, -0.5]
    with FakeOpenAIServer(serving("fake", lambda p, b: (200, generation(engine, CALL, values)))) as fake:
        policy = remote(fake.url)
        [gen] = policy.act(PROMPT, 1, CFG)
        assert fake.posts("/completions")[0]["logprobs"] == 1
    assert gen.token_logprobs == pytest.approx(values) and policy.caps.logprobs is True
    assert gen.text.endswith(CALL)


def test_llama_cpp_python_without_logits_all_decodes_without_logprobs() -> None:
    """Every request with `logprobs` is a 500: asked once, then never again; the calls still come back."""
    def post(path: str, body: dict) -> tuple[int, object]:
        if "logprobs" in body:
            return LLAMA_CPP_PYTHON_NO_LOGITS
        return 200, {"choices": [{"index": 0, "text": CALL, "finish_reason": "stop", "logprobs": None}]}

    with FakeOpenAIServer(serving("fake", post)) as fake:
        policy = remote(fake.url)
        first = policy.act(PROMPT, 1, CFG)[0]
        second = policy.rehearse([PROMPT], CFG)[0]
        assert first.text.endswith(CALL) and second.text.endswith(CALL) and first.token_logprobs == []
        assert policy.caps.logprobs is False
        assert [("logprobs" in b) for b in fake.posts("/completions")] == [True, False, False]
        assert policy.supports_scoring is False


def test_llama_cpp_refusing_n_gets_k_candidates_from_single_requests() -> None:
    def post(path: str, body: dict) -> tuple[int, object]:
        if body.get("n", 1) > 1:
            return LLAMA_CPP_ONE_CHOICE
        return 200, generation("llama.cpp", CALL, [-0.1, -0.2])

    with FakeOpenAIServer(serving("fake", post)) as fake:
        policy = remote(fake.url)
        gens = policy.act(PROMPT, 3, GenerationConfig(max_new_tokens=16, temperature=0.8, stop=("</tool_call>",)))
        assert len(gens) == 3 and all(g.text.endswith(CALL) for g in gens)
        assert policy.caps.n is False
        assert sum(1 for b in fake.posts("/completions") if b.get("n", 1) > 1) == 1  # refused once, not retried
        policy.act(PROMPT, 3, GenerationConfig(max_new_tokens=16, temperature=0.8, stop=("</tool_call>",)))
        assert sum(1 for b in fake.posts("/completions") if b.get("n", 1) > 1) == 1


# ---------------------------------------------------------------- constraints over HTTP

CALL_SCHEMA = {"type": "object", "properties": {"name": {"const": "get"}, "arguments": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}, "required": ["name", "arguments"]}
FORCED = Prompt(messages=PROMPT.messages, prefill="<tool_call>",
                constraint=Constraint(schema=CALL_SCHEMA, close="</tool_call>"))
FITS = '{"name": "get", "arguments": {"key": "color"}}'
FREE_TEXT = 'get(key="color")'
FORMS = {"vllm-lark": lambda b: (b.get("structured_outputs") or {}).get("grammar") == grammar_text(FORCED.constraint),
         "sglang-lark": lambda b: b.get("ebnf") == "%llguidance {}\n" + grammar_text(FORCED.constraint),
         "gbnf": lambda b: b.get("grammar") == gbnf_text(FORCED.constraint),
         "vllm": lambda b: b.get("structured_outputs") == {"json": CALL_SCHEMA},
         "openai": lambda b: (b.get("response_format") or {}).get("json_schema", {}).get("schema") == CALL_SCHEMA,
         "llama.cpp": lambda b: b.get("json_schema") == CALL_SCHEMA,
         "sglang": lambda b: isinstance(b.get("json_schema"), str) and json.loads(b["json_schema"]) == CALL_SCHEMA}


def engine_honouring(form: str | None, refuses_unknown: bool = False):
    """A server that keeps the constraint only in `form` (answers free text otherwise), optionally 422 on the
    fields it does not know (as `transformers serve` does)."""
    def post(path: str, body: dict) -> tuple[int, object]:
        sent = [f for f, has in FORMS.items() if has(body)]
        if refuses_unknown and any(f != form for f in sent):
            return 422, {"detail": [{"type": "extra_forbidden", "loc": ["body", "structured_outputs"],
                                     "msg": "Extra inputs are not permitted"}]}
        text = FITS if form in sent else FREE_TEXT
        return 200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}]}
    return post


def forms_sent(fake) -> list[str | None]:
    return [next((f for f, has in FORMS.items() if has(b)), None) for b in fake.posts("/completions")]


@pytest.mark.parametrize("engine", CONSTRAIN_FORMS)
def test_auto_finds_the_form_the_server_keeps(engine: str) -> None:
    expected_forms = [*CONSTRAIN_FORMS[: CONSTRAIN_FORMS.index(engine) + 1], engine]
    with FakeOpenAIServer(serving("fake", engine_honouring(engine))) as fake:
        policy = remote(fake.url)
        gens = [policy.act(FORCED, 1, CFG)[0] for _ in range(2)]  # the first finds the form, the second uses it
        assert forms_sent(fake) == expected_forms
    assert policy.constraints.form == engine and all(g.text == f"<tool_call>{FITS}</tool_call>" for g in gens)
    assert policy.constraint_note == f"constraints sent as {engine}: 2 of 2 answer(s) fit the schema"


def test_a_server_that_ignores_every_form_decodes_free_and_says_so() -> None:
    with FakeOpenAIServer(serving("fake", engine_honouring(None))) as fake:
        policy = remote(fake.url)
        texts = [policy.act(FORCED, 1, CFG)[0].text for _ in range(2)]
        assert forms_sent(fake) == [*CONSTRAIN_FORMS, None, None]
    assert policy.constraints.form is None and texts[-1] == f"<tool_call>{FREE_TEXT}</tool_call>"
    assert policy.constraint_note == ("constraints not kept by the server (it refused or ignored vllm-lark, "
                                      "sglang-lark, gbnf, vllm, openai, llama.cpp, sglang): decoding free, answers "
                                      "may not fit the schema")


def test_a_server_refusing_unknown_fields_gets_the_one_it_knows() -> None:
    with FakeOpenAIServer(serving("fake", engine_honouring("llama.cpp", refuses_unknown=True))) as fake:
        policy = remote(fake.url)
        gen = policy.act(FORCED, 1, CFG)[0]
    assert gen.text == f"<tool_call>{FITS}</tool_call>"
    assert policy.constraints.dropped == ["vllm-lark", "sglang-lark", "gbnf", "vllm", "openai"]
    assert policy.constraint_note == "constraints sent as llama.cpp: 1 of 1 answer(s) fit the schema"


def test_constrain_option_off_one_form_and_text_or_call_prompts() -> None:
    with FakeOpenAIServer(serving("fake", engine_honouring("vllm"))) as fake:
        off = model_backend.load_policy(f"openai:{fake.url}#fake{OPTS}&constrain=off")
        off.act(FORCED, 1, CFG)
        assert forms_sent(fake) == [None] and off.constraint_note == "constraints off (constrain=off): decoding free"
        one = model_backend.load_policy(f"openai:{fake.url}#fake{OPTS}&constrain=openai")
        one.act(FORCED, 1, CFG)
        one.act(FORCED, 1, CFG)  # not kept (free text), but asked for: still sent, and counted
        auto = model_backend.load_policy(f"openai:{fake.url}#fake{OPTS}&constrain=json_schema")
        text_or_call = Prompt(messages=PROMPT.messages, constraint=Constraint(
            schema=CALL_SCHEMA, open="<tool_call>", close="</tool_call>", allow_text=True))
        auto.act(text_or_call, 1, CFG)
        assert forms_sent(fake) == [None, "openai", "openai", None]
    assert one.constraint_note == "constraints sent as openai: 0 of 2 answer(s) fit the schema"
    assert auto.constraint_note == "constraints sent as vllm; 1 text-or-call prompt(s) sent free"
    with pytest.raises(model_backend.ModelSpecError, match=r"bad value for constrain .*'grammar' \(auto, off, lark, "
                                                           r"gbnf, json_schema, vllm-lark"):
        model_backend.parse_spec("openai:http://h/v1#m?constrain=grammar")


TEXT_OR_CALL = Prompt(messages=PROMPT.messages, constraint=Constraint(
    schema=CALL_SCHEMA, open="<tool_call>", close="</tool_call>", allow_text=True))


@pytest.mark.parametrize("choice, form", [("auto", "vllm-lark"), ("lark", "sglang-lark"), ("gbnf", "gbnf")])
def test_a_grammar_says_call_or_text_so_nothing_goes_free(choice: str, form: str) -> None:
    """A text-or-call prompt (tool_choice auto) goes constrained in a grammar form: the grammar holds both branches;
    a text answer and a tagged call both fit."""
    expected = {"gbnf": gbnf_text(TEXT_OR_CALL.constraint), "vllm-lark": grammar_text(TEXT_OR_CALL.constraint),
                "sglang-lark": "%llguidance {}\n" + grammar_text(TEXT_OR_CALL.constraint)}[form]

    def post(path: str, body: dict) -> tuple[int, object]:  # an engine that reads only `form`
        sent = {"vllm-lark": (body.get("structured_outputs") or {}).get("grammar"), "sglang-lark": body.get("ebnf"),
                "gbnf": body.get("grammar")}[form]
        text = ("The key is stored." if "stored" in body["prompt"] else f"<tool_call>{FITS}</tool_call>") \
            if sent == expected else "<tool_call>oops"
        return 200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}]}

    with FakeOpenAIServer(serving("fake", post)) as fake:
        policy = model_backend.load_policy(f"openai:{fake.url}#fake{OPTS}&constrain={choice}")
        call = policy.act(TEXT_OR_CALL, 1, CFG)[0]
        answer = policy.act(Prompt(messages=[*PROMPT.messages, {"role": "tool", "content": "stored"}],
                                   constraint=TEXT_OR_CALL.constraint), 1, CFG)[0]
    assert call.text == f"<tool_call>{FITS}</tool_call>" and answer.text == "The key is stored."
    assert policy.constraints.form == form and policy.constraints.free == 0
    # the text answer is no evidence (a model decoding free writes text too): only the call is counted
    assert policy.constraint_note == f"constraints sent as {form}: 1 of 1 answer(s) fit the schema"


def test_a_text_answer_does_not_make_an_ignored_grammar_look_kept() -> None:
    """llama-cpp-python ignores `structured_outputs`; a text answer to a text-or-call prompt fits either way, so only
    the first call decides: it breaks the schema and the form is dropped (a real run kept `vllm-lark` on two text
    answers and said "2 of 2 answer(s) fit")."""
    def post(path: str, body: dict) -> tuple[int, object]:
        text = "I will store it." if "tool" not in json.dumps(body["prompt"][-40:]) else "<tool_call>{\"nam"
        if body.get("grammar") == gbnf_text(TEXT_OR_CALL.constraint):
            text = f"<tool_call>{FITS}</tool_call>"
        return 200, {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}]}

    with FakeOpenAIServer(serving("fake", post)) as fake:
        policy = remote(fake.url)
        first = policy.act(TEXT_OR_CALL, 1, CFG)[0]
        assert first.text == "I will store it." and policy.constraints.form == "vllm-lark"
        assert policy.constraint_note == ""  # sent, nothing counted yet
        tool_prompt = Prompt(messages=[*PROMPT.messages, {"role": "user", "content": "use the tool"}],
                             constraint=TEXT_OR_CALL.constraint)
        second = policy.act(tool_prompt, 1, CFG)[0]
    assert second.text == f"<tool_call>{FITS}</tool_call>"
    assert policy.constraints.dropped == ["vllm-lark", "sglang-lark"] and policy.constraints.form == "gbnf"
    assert policy.constraint_note == "constraints sent as gbnf: 1 of 1 answer(s) fit the schema"


def test_a_group_tries_only_its_forms_then_goes_free() -> None:
    with FakeOpenAIServer(serving("fake", engine_honouring("vllm"))) as fake:  # a JSON-schema-only server
        policy = model_backend.load_policy(f"openai:{fake.url}#fake{OPTS}&constrain=lark")
        policy.act(FORCED, 1, CFG)
        policy.act(FORCED, 1, CFG)
        assert forms_sent(fake) == ["vllm-lark", "sglang-lark", None, None]
    assert policy.constraints.form is None and policy.constraints.dropped == ["vllm-lark", "sglang-lark"]
    assert policy.constraint_note.startswith("constraints not kept by the server (it refused or ignored vllm-lark, "
                                             "sglang-lark)")
