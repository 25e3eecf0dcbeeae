"""The `openai:` backend: bad input against a test double (fast), and a real `transformers serve` (slow).

The double (`fake_openai.FakeOpenAIServer`) misbehaves on purpose: malformed JSON, no choices,
a 429 storm, a cut-off answer, a server that dies mid-episode. The real server is
`transformers serve` on the embedded model's converted checkpoint, started once for the module.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fake_openai import FakeOpenAIServer, chat_reply, free_port, kv_agent, models_reply, serving

import model_backend
from model_backend.base import NO_PROMPT_LOGPROBS, Constraint, GenerationConfig, Prompt, RemoteCapabilityError
from model_backend.remote import (OpenAIPolicy, RemoteError, RemoteModelError, RemoteResponseError,
                                  RemoteUnavailableError, parse_remote_target)
from model_backend.spec import CONSTRAIN_FORMS

ROOT = Path(__file__).resolve().parent.parent
FAST = "?retries=3&backoff=0.01&timeout=10"
CFG = GenerationConfig(max_new_tokens=16, stop=("</tool_call>",))
PROMPT = Prompt(messages=[{"role": "system", "content": "You are an assistant."},
                          {"role": "user", "content": "Store blue under color."}])


def remote(url: str, model: str = "fake", opts: str = FAST) -> OpenAIPolicy:
    return model_backend.load_policy(f"openai:{url}#{model}{opts}")  # type: ignore[return-value]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


# ---------------------------------------------------------------- the spec


@pytest.mark.parametrize("target,base,model", [
    ("http://localhost:8000/v1#Qwen/Qwen3-8B", "http://localhost:8000/v1", "Qwen/Qwen3-8B"),
    ("http://localhost:8000#m", "http://localhost:8000/v1", "m"),
    ("https://h.example/api/v1/#org/m?tokenizer=hf:org/m&retries=2", "https://h.example/api/v1", "org/m"),
])
def test_parse_remote_target(target: str, base: str, model: str) -> None:
    opts = parse_remote_target(target)
    assert (opts.base_url, opts.model) == (base, model)
    assert model_backend.parse_spec(f"openai:{target}").kind == "openai"


def test_adapter_is_refused_for_a_server() -> None:
    with pytest.raises(model_backend.AdapterError, match="--lora-modules"):
        model_backend.load_policy("openai:http://127.0.0.1:1/v1#m", adapter="fixtures/x")


# ---------------------------------------------------------------- bad input


def test_unreachable_url_is_one_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(RemoteUnavailableError, match="cannot reach .* after 3 attempts.*is the server running"):
        remote(url)


def test_unreachable_url_from_the_cli(tmp_path: Path) -> None:
    out = run_cli("run", "--task", "mock:kv", "--model", f"openai:http://127.0.0.1:{free_port()}/v1#m{FAST}",
                  "--selector", "logprob", "--db", str(tmp_path / "x.db"))
    one_line_error(out, "cannot reach")


def test_wrong_model_name_lists_what_is_served() -> None:
    with FakeOpenAIServer(serving("Qwen/Qwen3-8B", lambda p, b: (500, {}))) as fake:
        with pytest.raises(RemoteModelError, match=r"'qwen3' is not served .*\(it serves: Qwen/Qwen3-8B\)"):
            remote(fake.url, "qwen3")


def test_server_without_models_endpoint_names_the_model_error_on_use() -> None:
    def handler(method: str, path: str, body: dict) -> tuple[int, object]:
        if path.endswith("/models"):
            return 404, {"detail": "Not Found"}
        return 400, {"error": {"message": "The model `m` does not exist."}}

    with FakeOpenAIServer(handler) as fake:
        policy = remote(fake.url, "m")
        with pytest.raises(RemoteModelError, match="does not exist"):
            policy.act(PROMPT, 1, CFG)


@pytest.mark.parametrize("payload,message", [
    (b"<html>Bad Gateway</html>", "not JSON"),
    ({"choices": []}, "no choices"),
    ({"id": "x"}, "no choices"),
    ({"choices": [{"index": 0, "message": {"role": "assistant"}, "finish_reason": "stop"}]}, None),
    ({"choices": [{"index": 0, "text": 3}]}, "without a message"),
])
def test_malformed_answers_are_clear_errors(payload: object, message: str | None) -> None:
    with FakeOpenAIServer(serving("fake", lambda p, b: (200, payload))) as fake:
        policy = remote(fake.url)
        if message is None:  # an empty message is an empty reply, not an error: the engine records a parse error
            assert policy.act(PROMPT, 1, CFG)[0].text == ""
            return
        with pytest.raises(RemoteResponseError, match=message):
            policy.act(PROMPT, 1, CFG)


def test_429_storm_is_bounded_then_clear() -> None:
    with FakeOpenAIServer(serving("fake", lambda p, b: (429, {"error": "rate limited"}))) as fake:
        policy = remote(fake.url)
        with pytest.raises(RemoteUnavailableError, match="kept answering 429 .*3 attempts"):
            policy.act(PROMPT, 1, CFG)
        assert len(fake.posts("/chat/completions")) == 3


def test_transient_errors_are_retried() -> None:
    calls = {"n": 0}

    def post(path: str, body: dict) -> tuple[int, object]:
        calls["n"] += 1
        return (503, {"error": "loading"}) if calls["n"] <= 2 else (200, chat_reply("hello"))

    with FakeOpenAIServer(serving("fake", post)) as fake:
        assert remote(fake.url).act(PROMPT, 1, CFG)[0].text == "hello"
        assert calls["n"] == 3


def test_cut_off_answer_is_an_unfinished_generation() -> None:
    with FakeOpenAIServer(serving("fake", lambda p, b: (200, chat_reply('<tool_call>{"name": "se', "length")))) as fake:
        gen = remote(fake.url).act(PROMPT, 1, CFG)[0]
    assert gen.finished is False and gen.text == '<tool_call>{"name": "se'


def test_api_key_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVACE_API_KEY", "sk-test")
    with FakeOpenAIServer(serving("fake", lambda p, b: (200, chat_reply("hi")))) as fake:
        remote(fake.url).act(PROMPT, 1, CFG)
        assert fake.posts()[0]["_headers"]["Authorization"] == "Bearer sk-test"


def test_refused_key_says_which_variable() -> None:
    with FakeOpenAIServer(lambda m, p, b: (401, {"error": {"message": "bad key"}})) as fake:
        with pytest.raises(RemoteError, match="ENVACE_API_KEY"):
            remote(fake.url)


# ---------------------------------------------------------------- protocol


def test_k_candidates_use_n_and_fall_back_to_concurrent_requests() -> None:
    def post(path: str, body: dict) -> tuple[int, object]:
        return 200, chat_reply(f"t={body['temperature']} seed={body.get('seed')}")  # ignores n, as transformers serve

    with FakeOpenAIServer(serving("fake", post)) as fake:
        policy = remote(fake.url)
        gens = policy.act(PROMPT, 4, GenerationConfig(max_new_tokens=8, temperature=0.7, seed=3))
        assert len(gens) == 4 and gens[0].text.startswith("t=0.0") and not gens[0].sampled
        assert all(g.sampled and g.text.startswith("t=0.7") for g in gens[1:])
        assert len({g.text for g in gens[1:]}) == 3  # distinct seeds per row
        assert policy.caps.n is False
        before = len(fake.posts())
        policy.act(PROMPT, 4, GenerationConfig(max_new_tokens=8, temperature=0.7, seed=3))
        assert len(fake.posts()) - before == 4 and all("n" not in b for b in fake.posts()[before:])


def test_n_is_used_where_the_server_honours_it() -> None:
    def post(path: str, body: dict) -> tuple[int, object]:
        return 200, chat_reply("x", n=body.get("n", 1))

    with FakeOpenAIServer(serving("fake", post)) as fake:
        policy = remote(fake.url)
        assert len(policy.act(PROMPT, 4, CFG)) == 4
        assert len(fake.posts()) == 2 and fake.posts()[1].get("n", fake.posts()[0].get("n")) == 3
        assert policy.caps.n is True


def test_sampling_switch_for_transformers_serve() -> None:
    def handler(method: str, path: str, body: dict) -> tuple[int, object]:
        if path.endswith("/models"):  # transformers serve's listing carries a status
            return 200, {"data": [{"id": "fake", "object": "model", "status": {"value": "loaded"}}]}
        return 200, chat_reply("x")

    with FakeOpenAIServer(handler) as fake:
        remote(fake.url).act(PROMPT, 2, GenerationConfig(max_new_tokens=4, temperature=0.5))
        greedy, sampled = sorted(fake.posts(), key=lambda b: b["temperature"])
        assert "generation_config" not in greedy and json.loads(sampled["generation_config"]) == {"do_sample": True}
    with FakeOpenAIServer(serving("fake", lambda p, b: (200, chat_reply("x")))) as fake:  # vLLM-like listing
        remote(fake.url).act(PROMPT, 2, GenerationConfig(max_new_tokens=4, temperature=0.5))
        assert all("generation_config" not in b for b in fake.posts())


def test_prefill_continues_or_is_put_back() -> None:
    prompt = Prompt(messages=PROMPT.messages, prefill="<execution_result>")

    def vllm_like(path: str, body: dict) -> tuple[int, object]:
        assert body["continue_final_message"] and body["messages"][-1]["content"] == "<execution_result>"
        return 200, chat_reply('{"ok": true}', stop_reason="</execution_result>")

    cfg = GenerationConfig(stop=("</execution_result>",))
    with FakeOpenAIServer(serving("fake", vllm_like)) as fake:
        gen = remote(fake.url).rehearse([prompt], cfg)[0]
    assert gen.text == '<execution_result>{"ok": true}</execution_result>'

    def strict(path: str, body: dict) -> tuple[int, object]:  # transformers serve: 422 on unknown fields
        if "continue_final_message" in body:
            return 422, {"detail": "Unexpected fields in the request: {'continue_final_message'}"}
        return 200, chat_reply('{"ok": true}')

    with FakeOpenAIServer(serving("fake", strict)) as fake:
        policy = remote(fake.url)
        gen = policy.rehearse([prompt], cfg)[0]
        assert policy.caps.continue_final is False
    assert gen.text == '<execution_result>{"ok": true}</execution_result>'


def test_server_parsed_tool_calls_become_our_text() -> None:
    reply = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": '{"key": "a"}'}}]}}]}
    with FakeOpenAIServer(serving("fake", lambda p, b: (200, reply))) as fake:
        gen = remote(fake.url).act(PROMPT, 1, CFG)[0]
    assert gen.text == '<tool_call>{"name": "get", "arguments": {"key": "a"}}</tool_call>'


def test_score_reads_echoed_prompt_logprobs(tmp_path: Path) -> None:
    def vllm_echo(path: str, body: dict) -> tuple[int, object]:
        text = body["prompt"]
        pieces = [text[:-4], text[-4:-2], text[-2:]]  # three "tokens"
        offsets = [0, len(pieces[0]), len(pieces[0]) + 2]
        return 200, {"choices": [{"index": 0, "text": text + "!", "finish_reason": "length", "logprobs": {
            "tokens": pieces + ["!"], "token_logprobs": [None, -1.0, -2.0, -0.5],
            "text_offset": offsets + [len(text)]}}]}

    with FakeOpenAIServer(serving("fake", vllm_echo)) as fake:
        policy = remote(fake.url, opts=FAST + "&tokenizer=embedded")
        assert policy.prompt_mode == "completions"
        assert policy.supports_scoring
        assert policy.score([PROMPT], ["yes!"]) == [[-1.0, -2.0]]


def test_no_prompt_logprobs_is_a_capability_error() -> None:
    with FakeOpenAIServer(serving("fake", lambda p, b: (200, {"choices": [
            {"index": 0, "text": "x", "finish_reason": "stop"}]}))) as fake:
        policy = remote(fake.url, opts=FAST + "&tokenizer=embedded")
        assert policy.supports_scoring is False
        with pytest.raises(RemoteCapabilityError, match="use --selector logprob or memory"):
            policy.score([PROMPT], ["yes"])
    assert NO_PROMPT_LOGPROBS == "this server returns no prompt logprobs: use --selector logprob or memory"


def test_count_tokens_estimates_without_a_tokenizer() -> None:
    with FakeOpenAIServer(serving("Qwen/Qwen3-8B", lambda p, b: (200, chat_reply("x")))) as fake:
        policy = remote(fake.url, "Qwen/Qwen3-8B")
        assert policy.tokenizer is None and policy.prompt_mode == "chat"
        assert policy.count_tokens("x" * 41) == 11 and policy.context_window == 8192


# ---------------------------------------------------------------- episodes through the CLI


def test_cli_refuses_judge_without_prompt_logprobs(tmp_path: Path) -> None:
    with FakeOpenAIServer(serving("fake", kv_agent)) as fake:
        out = run_cli("run", "--task", "mock:kv", "--model", f"openai:{fake.url}#fake{FAST}",
                      "--db", str(tmp_path / "x.db"))
    one_line_error(out, NO_PROMPT_LOGPROBS)


def test_episode_through_a_scripted_server(tmp_path: Path) -> None:
    from app.store import Store

    db = tmp_path / "x.db"
    with FakeOpenAIServer(serving("fake", kv_agent)) as fake:
        out = run_cli("run", "--task", "mock:kv", "--model", f"openai:{fake.url}#fake{FAST}", "--selector", "logprob",
                      "-k", "2", "--db", str(db), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["success"] is True
    assert summary["end_reason"] == "answered"
    assert "Ended: all 2 user turns done: the agent answered the last one" in out.stderr  # the account's last line
    ep = Store(str(db)).get_episode(summary["episode_id"])
    assert ep.status == "finished" and len(ep.steps) == len(summary["steps"])
    rehearsed = [b for s in ep.steps for b in s.branches if b.predicted_text is not None]
    assert rehearsed and all(b.predicted == {"ok": True} for b in rehearsed)
    assert all(b.metrics.surprise is None for b in rehearsed if b.metrics)  # no prompt logprobs: no surprise


def test_server_dying_mid_episode_keeps_the_complete_steps(tmp_path: Path) -> None:
    from app.store import Store

    calls = {"act": 0}

    def dying(path: str, body: dict) -> tuple[int, object]:
        if body["messages"][0]["content"].startswith("You are an assistant"):
            calls["act"] += 1
        if calls["act"] > 2:  # the third Act request and everything after it
            return 503, {"error": "server going away"}
        return kv_agent(path, body)

    db = tmp_path / "x.db"
    with FakeOpenAIServer(serving("fake", dying)) as fake:
        out = run_cli("run", "--task", "mock:kv", "--model", f"openai:{fake.url}#fake{FAST}", "--mode", "none",
                      "--db", str(db))
    one_line_error(out, "HTTP 503", "marked failed", "2 complete step(s)")
    store = Store(str(db))
    (row,) = store.list_episodes()
    ep = store.get_episode(row["id"])
    assert ep.status == "failed" and "503" in (ep.error or "") and ep.end_reason == "failed"
    assert len(ep.steps) == 2 and ep.steps[0].chosen_branch.call.name == "set"
    assert ep.steps[1].kind == "answer"


# ---------------------------------------------------------------- a real server: transformers serve


@pytest.fixture(scope="module")
def served() -> tuple[str, str]:
    """`transformers serve` on the embedded model's converted checkpoint, on a free localhost port.

    Started once for the module (loading the model is the slow part) and stopped at the end.
    Yields (base_url, model name); the model name is the checkpoint directory, as the server lists it.
    """
    import served as serve

    ckpt = serve.embedded_checkpoint()
    try:
        proc, url, _ = serve.start(ckpt)
    except serve.ServeError as exc:
        pytest.fail(str(exc))
    try:
        yield url, str(ckpt)
    finally:
        serve.stop(proc)


@pytest.fixture(scope="module")
def local():
    return model_backend.load_policy("embedded")  # the bare base weights, as the server serves them


@pytest.mark.slow
def test_greedy_act_and_rehearse_match_the_local_backend(served: tuple[str, str], local) -> None:
    from app.envs import load_task
    from app.formats import ACT_STOP, REHEARSE_STOP, HistoryItem, act_prompt, rehearse_prompt
    from app.records import Call

    url, model = served
    policy = remote(url, model, opts="?timeout=300")
    assert policy.prompt_mode == "completions" and policy.tokenizer is not None
    task = load_task("mock:kv")
    from app.envs import make_env

    tools = make_env(task).tools()
    history = [HistoryItem(role="user", content=task.turns[0][0]["content"])]
    prompt = act_prompt(tools, history, policy.count_tokens, policy.context_window, prefill="<tool_call>")
    assert prompt == act_prompt(tools, history, local.count_tokens, local.context_window, prefill="<tool_call>")
    cfg = GenerationConfig(max_new_tokens=24, stop=ACT_STOP)
    theirs, ours = policy.act(prompt, 1, cfg)[0], local.act(prompt, 1, cfg)[0]
    assert theirs.text == ours.text and theirs.finished == ours.finished and not theirs.sampled
    rp = rehearse_prompt(tools[0], Call(name="get", arguments={"key": "size"}), history)
    rcfg = GenerationConfig(max_new_tokens=24, stop=REHEARSE_STOP)
    assert policy.rehearse([rp], rcfg)[0].text == local.rehearse([rp], rcfg)[0].text


@pytest.mark.slow
def test_transformers_serve_capabilities(served: tuple[str, str]) -> None:
    url, model = served
    policy = remote(url, model, opts="?timeout=300")
    gens = policy.act(PROMPT, 4, GenerationConfig(max_new_tokens=8, temperature=1.0, seed=1))
    assert len(gens) == 4 and not gens[0].sampled and all(g.sampled for g in gens[1:])
    assert policy.options.do_sample is True and len({g.text for g in gens}) >= 2  # it really samples
    assert policy.caps.n is False and policy.caps.logprobs is False  # it ignores `n` and `logprobs`
    assert policy.supports_scoring is False  # no `echo` + prompt logprobs
    # It refuses every constraint form (422 "Unexpected fields"): each is dropped, decoding goes free, and says so.
    forced = Prompt(messages=PROMPT.messages, prefill="<tool_call>",
                    constraint=Constraint(schema={"type": "object"}, close="</tool_call>"))
    assert policy.act(forced, 1, GenerationConfig(max_new_tokens=8))[0].text.startswith("<tool_call>")
    assert policy.constraints.form is None and policy.constraints.dropped == list(CONSTRAIN_FORMS)
    assert policy.constraint_note.startswith("constraints not kept by the server")
    with pytest.raises(RemoteModelError, match="is not served"):
        remote(url, "HuggingFaceTB/SmolLM2-135M-Instruct")


@pytest.mark.slow
def test_episode_through_transformers_serve(served: tuple[str, str], tmp_path: Path) -> None:
    from app.store import Store

    url, model = served
    spec = f"openai:{url}#{model}?timeout=300"
    db = tmp_path / "served.db"
    refused = run_cli("run", "--task", "mock:kv", "--model", spec, "--db", str(db))
    one_line_error(refused, NO_PROMPT_LOGPROBS)
    out = run_cli("run", "--task", "mock:kv", "--model", spec, "--selector", "logprob", "-k", "2",
                  "--tool-choice", "required", "--max-steps", "1", "--max-action-tokens", "32",
                  "--max-rehearsal-tokens", "24", "--db", str(db), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    ep = Store(str(db)).get_episode(summary["episode_id"])
    assert ep.status == "finished" and ep.model == spec and len(ep.steps) == 2  # two turns, one step each
    for step in ep.steps:
        assert step.branches and step.branches[step.chosen].chosen
        assert all(b.action_text.startswith("<tool_call>") for b in step.branches)
        for b in step.branches:
            if b.kind == "call":
                assert b.predicted_text is not None and b.predicted_text.startswith("<execution_result>")
                assert b.metrics.surprise is None


# ---------------------------------------------------------------- the UI's service layer


def test_ui_service_accepts_openai_specs_and_says_what_is_wrong(tmp_path: Path) -> None:
    from app.service import InputError, RunRequest, RunSession, Services
    from app.records import RunSettings

    services = Services(str(tmp_path / "ui.db"))
    session = RunSession()
    down = RunRequest(task_id="mock:kv", model=f"openai:http://127.0.0.1:{free_port()}/v1#m{FAST}")
    with pytest.raises(InputError, match="Could not load model .*cannot reach"):
        session.step(services, down)
    with FakeOpenAIServer(serving("fake", kv_agent)) as fake:
        spec = f"openai:{fake.url}#fake{FAST}"
        with pytest.raises(InputError, match="Selector judge needs prompt log-probabilities"):
            session.step(services, RunRequest(task_id="mock:kv", model=spec))
        request = RunRequest(task_id="mock:kv", model=spec, settings=RunSettings(selector="logprob", branches=2))
        step = session.step(services, request)
        assert step is not None and step.branches[step.chosen].call.name == "set"
    with pytest.raises(InputError, match="The step failed and the episode was marked failed: cannot reach"):
        session.step(services, request)  # the server is gone: the saved step stays, the episode is marked
    stored = services.store.get_episode(session.episode.id)
    assert stored.status == "failed" and len(stored.steps) == 1
