"""The inspector's main events through gradio_client, with a scripted policy (no model, seconds).

One app per module, served on a free port; each test uses its own client, so its own
browser session. The real model and a real browser are exercised in test_ui_browser.py.
"""
from __future__ import annotations

import re
import sys
import threading

import pytest
from gradio_client import Client
from helpers import form, gradio_queue_idle, wait_until
from scripted import ScriptedPolicy

from app.ui import SWITCH_INTERVAL_S, build_demo, close_demo
from app.ui import constants as C

LS = '<tool_call>{"name": "ls", "arguments": {}}</tool_call>'
PWD = '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>'
MKDIR = '<tool_call>{"name": "mkdir", "arguments": {"dir_name": "temp"}}</tool_call>'
ACTING, RELEASE = threading.Event(), threading.Event()


class SlowPolicy(ScriptedPolicy):
    """Acts only once the test lets it (RELEASE), saying when it has started (ACTING), so that a second Step
    surely arrives while the first works."""

    def act(self, prompt, k, config):
        ACTING.set()
        assert RELEASE.wait(60), "the test never released the step"
        return super().act(prompt, k, config)


def loader(model: str, adapter: str | None):
    cls = SlowPolicy if model == "slow" else ScriptedPolicy
    # Enough script for every test; afterwards the policy answers "Done." (which ends turns).
    return cls([[LS, PWD, MKDIR]] * 400, predict=lambda prompt: {"current_directory_content": ["document"]})



@pytest.fixture(scope="module")
def app(tmp_path_factory):
    db = tmp_path_factory.mktemp("ui") / "ui.db"
    demo = build_demo(db_path=str(db), policy_loader=loader)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)  # first free port
    yield demo, url
    close_demo(demo)


def client(app) -> Client:
    return Client(app[1], verbose=False)


def counts(app) -> dict[str, int]:
    db = app[0].services.store.db
    return {t: db[t].count for t in ("episodes", "steps", "branches", "annotations")}


def test_the_server_takes_the_gil_back_quickly(app):
    # The model's worker thread retakes the GIL at every tensor op; Python's 5 ms default let a busy callback
    # stall a step (bench/bench_gil.py). The server process runs at SWITCH_INTERVAL_S.
    assert SWITCH_INTERVAL_S < 0.005
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)


def test_step_shows_branches_and_saves_the_step(app):
    c = client(app)
    before = counts(app)
    message, status, chat, timeline, cards, state = c.predict(**form(), api_name="/step")
    assert "ea-msg-error" not in message
    assert cards.count('data-branch=') == 3 and cards.count("ea-committed") == 1
    assert "Predicted" in cards and "Actual · committed" in cards and "Actual · shadow" in cards
    assert "Actual · none" not in cards  # mkdir is a write: it runs on its own fork too
    assert "Fork state diff" in cards and "temp" in cards
    assert "Diff: predicted (-) vs actual (+)" in cards and "field_f1" in cards
    assert chat[0]["role"] == "user" and "**Step 0 · tool call** `ls({})`" in chat[1]["content"][0]["text"]
    assert not chat[1].get("metadata")  # an open message, not a collapsed bubble
    assert timeline["choices"] == [["0 · t1 · ls({})", 0]]
    assert "State diff, step 0" in state and "**in progress**, 1 step(s)" in status
    assert "3 proposed → " in cards and 'title="F1 over the' in cards
    after = counts(app)
    assert after["episodes"] == before["episodes"] + 1 and after["steps"] == before["steps"] + 1
    assert after["branches"] == before["branches"] + 3

    # A second step continues the same episode; the timeline reopens the first.
    c.predict(**form(), api_name="/step")
    assert counts(app)["episodes"] == after["episodes"]
    cards0, state0 = c.predict(0, api_name="/show_step")
    assert "Step 0 ·" in cards0 and "State diff, step 0" in state0


def test_step_with_tool_alternatives(app):
    """Candidates `tools`: the greedy call, then calls forced onto other tools, one card each, and the
    episode's settings say so."""
    c = client(app)
    message, status, chat, timeline, cards, state = c.predict(**form(proposal="tools"), api_name="/step")
    assert "ea-msg-error" not in message and "candidates tools" in status
    assert cards.count('data-branch=') == 3 and "3 proposed → 3 unique" in cards
    names = re.findall(r'class="ea-action">(\w+)\(', cards)
    assert names[0] == "ls" and len(set(names[:3])) == 3, names


def test_step_with_tool_relevance(app):
    """Tool relevance on: the episode's settings say so, and each call's card shows its tool's score
    under the ranking."""
    c = client(app)
    message, status, chat, timeline, cards, state = c.predict(**form(relevance=1), api_name="/step")
    assert "ea-msg-error" not in message and "relevance 1" in status
    assert re.search(r"scores: tool -?\d+\.\d{3}", cards), cards


@pytest.mark.parametrize("overrides, expected", [
    ({"branches": 0}, "K (branches) must be a whole number from 1 to 16; got 0."),
    ({"branches": 100}, "K (branches) must be a whole number from 1 to 16; got 100."),
    ({"seed": -1}, "Seed must be a whole number from 0 to 2147483647; got -1."),
    ({"seed": 2**31}, "Seed must be a whole number from 0 to 2147483647"),
    ({"relevance": 5}, "Tool relevance must be a number from 0 to 4; got 5."),
    ({"relevance": -0.5}, "Tool relevance must be a number from 0 to 4; got -0.5."),
    ({"task": ""}, "No task selected"),
    ({"task": "bfcl:no_such_task_1"}, "no_such_task"),
    ({"source": C.SOURCE_INSTRUCTION, "instruction": "  "}, "The instruction is empty"),
    ({"model": ""}, "Model is empty"),
])
def test_bad_input_is_answered_and_nothing_is_written(app, overrides, expected):
    c = client(app)
    before = counts(app)
    message, *_ = c.predict(**form(**overrides), api_name="/step")
    assert "ea-msg-error" in message and expected in message
    assert counts(app) == before


def test_two_steps_at_once_one_is_refused(app):
    c = client(app)
    ACTING.clear(), RELEASE.clear()
    try:
        first = c.submit(**form(model="slow"), api_name="/step")
        wait_until(ACTING.is_set, 60, message="the first step never reached the policy")
        assert not gradio_queue_idle(app[0])  # the helper the browser tests wait on sees the running step
        refused = c.submit(**form(model="slow"), api_name="/step").result()[0]  # answered while the first acts
    finally:
        RELEASE.set()
    assert "A step is already running in this session" in refused and "ea-msg-error" in refused
    done = first.result()[0]
    assert "ea-msg-error" not in done and "already running" not in done
    wait_until(lambda: gradio_queue_idle(app[0]), 30, message="the queue kept a finished step")


def test_sessions_do_not_see_each_others_runs(app):
    a, b = client(app), client(app)
    status_a = a.predict(**form(), api_name="/step")[1]
    message_b, status_b = b.predict(api_name="/stop")
    assert "Nothing to stop" in message_b and "No episode yet" in status_b
    status_b = b.predict(**form(), api_name="/step")[1]
    episode = lambda status: status.split("`")[1]  # noqa: E731
    assert episode(status_a) != episode(status_b)


def test_run_to_end_then_step_then_reset(app):
    c = client(app)
    _, status, *_ = c.predict(**form(task="mock:kv", branches=2), api_name="/run_to_end")
    assert "**finished**" in status and "**Ended:** all 2 user turns done: the last one" in status
    message = c.predict(**form(task="mock:kv", branches=2), api_name="/step")[0]
    assert "This episode is over (all 2 user turns done: the last one" in message and "press Reset" in message
    message, status, chat, *_ = c.predict(**form(task="mock:kv", branches=2), api_name="/reset")
    assert "Reset" in message and "No episode yet" in status
    assert chat[0]["role"] == "user" and "blue" in chat[0]["content"][0]["text"]


def test_changing_settings_starts_a_new_episode(app):
    c = client(app)
    first = c.predict(**form(task="mock:kv"), api_name="/step")[1].split("`")[1]
    message, status, *_ = c.predict(**form(task="mock:kv", seed=7), api_name="/step")
    assert "started a new episode" in message and status.split("`")[1] != first
    assert app[0].services.store.get_episode(first).status == "stopped"


def test_typed_instruction_runs_unjudged(app):
    c = client(app)
    _, status, chat, *_ = c.predict(**form(source=C.SOURCE_INSTRUCTION, instruction="List my files.",
                                           branches=2), api_name="/run_to_end")
    assert "task `instruction:GorillaFileSystem`" in status and "success –" in status
    ep_id = status.split("`")[1]
    ep = app[0].services.store.get_episode(ep_id)
    assert ep.status == "finished" and ep.success is None
    assert chat[0]["content"][0]["text"] == "List my files."


def test_traces_list_open_replay_and_compare(app):
    c = client(app)
    ids = []
    for mode in ("none", "parallel"):
        status = c.predict(**form(task="mock:kv", mode=mode, branches=2), api_name="/run_turn")[1]
        ids.append(status.split("`")[1])
        c.predict(**form(), api_name="/reset")
    table, message, _ = c.predict(task="mock:kv", env_class=C.ALL, mode="none", since="", until="",
                                  api_name="/list_episodes")
    assert ids[0] in [row[0] for row in table["data"]] and ids[1] not in [row[0] for row in table["data"]]
    bad = c.predict(task="", since="yesterday", until="", api_name="/list_episodes")[1]
    assert "must be a date written YYYY-MM-DD" in bad
    message, status, step, chat, cards, state = c.predict(ids[1], api_name="/open_episode")
    assert ids[1] in status and "Step 0 ·" in cards
    chat, cards, state = c.predict(1, api_name="/replay_step")
    assert "Step 1 ·" in cards
    # The scripted policy commits ls() at every step in either mode: the same actions, nothing marked.
    html = c.predict(ids[0], ids[1], api_name="/compare_episodes")
    assert "They commit the same actions at every step." in html and "ea-first-diff" not in html
    c.predict(**form(), api_name="/reset")
    short = c.predict(**form(task="mock:kv", mode="none"), api_name="/step")[1].split("`")[1]  # one step only
    html = c.predict(ids[0], short, api_name="/compare_episodes")
    assert "First difference at step 1." in html and html.count("ea-first-diff") == 1


def test_traces_export_then_import_and_bad_files(app, tmp_path, monkeypatch):
    import json

    from gradio_client import handle_file

    c = client(app)
    status = c.predict(**form(task="mock:kv", mode="parallel", branches=2), api_name="/run_turn")[1]
    episode_id = status.split("`")[1]
    c.predict(**form(), api_name="/reset")
    table = c.predict(task="mock:kv", env_class=C.ALL, mode="parallel", since="", until="",
                      api_name="/list_episodes")[0]
    listed = [row[0] for row in table["data"]]
    assert episode_id in listed
    download, message = c.predict({"headers": table["headers"], "data": [table["data"][listed.index(episode_id)]]},
                                  api_name="/export_episodes")
    assert "Exported 1 episode(s)." in message
    lines = open(download, encoding="utf-8").read().splitlines()
    assert [json.loads(line)["episode"]["id"] for line in lines] == [episode_id]

    before = counts(app)
    message = c.predict(handle_file(download), False, api_name="/import_episodes")
    assert f"Nothing was imported: episode {episode_id} is already in" in message and counts(app) == before
    message = c.predict(handle_file(download), True, api_name="/import_episodes")
    assert "Imported 0 episode(s) with 0 annotation(s); 1 already here were skipped." in message

    record = json.loads(lines[0])
    record["episode"]["id"] = "copied-episode"
    good = tmp_path / "copy.jsonl"
    good.write_text(json.dumps(record) + "\n")
    assert "Imported 1 episode(s)" in c.predict(handle_file(str(good)), False, api_name="/import_episodes")
    assert counts(app)["episodes"] == before["episodes"] + 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(record) + "\n{oops\n")
    message = c.predict(handle_file(str(bad)), False, api_name="/import_episodes")
    assert "Nothing was imported: line 2: not JSON" in message
    monkeypatch.setattr(C, "MAX_IMPORT_MB", 0.001)  # about 1 KiB: the file above is larger
    message = c.predict(handle_file(str(good)), True, api_name="/import_episodes")
    assert "Nothing was imported: the file is" in message and "the limit is 1.02 KiB" in message
    assert counts(app)["episodes"] == before["episodes"] + 1
    assert "No episodes listed" in c.predict({"headers": ["id"], "data": []}, api_name="/export_episodes")[1]


def test_annotate_validates_then_saves(app):
    c = client(app)
    c.predict(**form(task="mock:kv"), api_name="/step")
    message, header, card, *_ = c.predict(False, False, C.ALL, C.ALL, api_name="/annotation_queue")
    assert "Branch 1 of" in header and 'data-branch=' in card
    before = counts(app)
    bad = c.predict("major", '{"missing": ', "", "", "tester", api_name="/annotate_save")[0]
    assert "not valid JSON" in bad and counts(app) == before
    no_name = c.predict("major", "", "", "", "", api_name="/annotate_save")[0]
    assert "Annotator is empty" in no_name and counts(app) == before
    ok = c.predict("major", '{"value": "blue"}', "", "predicted the wrong key", "tester",
                   api_name="/annotate_save")[0]
    assert "Saved annotation" in ok and counts(app)["annotations"] == before["annotations"] + 1
    row = app[0].services.store.annotations()[-1]
    assert row["label"] == "major" and row["corrected_predicted"] == '{"value": "blue"}'
    c.predict(api_name="/annotate_prev")
    plain = c.predict("major", "", "It is blue.", "", "tester", False, api_name="/annotate_save")[0]
    assert "not a tool call" in plain and counts(app)["annotations"] == before["annotations"] + 1
    answer = c.predict("major", "null", "It is blue.", "", "tester", True, api_name="/annotate_save")[0]
    assert "Saved annotation" in answer and counts(app)["annotations"] == before["annotations"] + 2
    row = app[0].services.store.annotations()[-1]
    assert row["corrected_action_kind"] == "answer" and row["corrected_predicted_set"] == 1
    assert row["corrected_predicted"] is None


def test_dashboard_returns_five_figures(app):
    c = client(app)
    c.predict(**form(task="mock:kv"), api_name="/step")
    message, *figures = c.predict(C.ALL, C.ALL, C.ALL, "", "", api_name="/dashboard")
    assert message == "" and len(figures) == 5 and all(f["type"] == "plotly" for f in figures)
    assert "error" in c.predict(C.ALL, C.ALL, C.ALL, "2026-13", "", api_name="/dashboard")[0]


def test_task_filter_by_environment_class(app):
    c = client(app)
    update = c.predict("MathAPI", C.ALL, "", C.DEFAULT_TASK, api_name="/filter_tasks")
    ids = [value for _, value in update["choices"]]
    catalog = app[0].services.catalog
    assert ids and all("MathAPI" in catalog.env_classes_of(i) for i in ids)
    assert update["value"] == ids[0]  # the default task has no MathAPI: the first match is picked
    update = c.predict(C.ALL, C.ALL, "tweet", C.DEFAULT_TASK, api_name="/filter_tasks")
    ids = [value for _, value in update["choices"]]
    assert C.DEFAULT_TASK in ids and update["value"] == C.DEFAULT_TASK  # TwitterAPI's: it stays picked
    assert set(catalog.ids_with_class("TwitterAPI")) <= set(ids)
    update = c.predict(C.ALL, C.ALL, "zzz-no-such-word", C.DEFAULT_TASK, api_name="/filter_tasks")
    assert update["choices"] == [] and "no task matches" in update["info"]


def test_space_entry_installs_only_missing_nodeps_pins(tmp_path, monkeypatch):
    import importlib.util
    from pathlib import Path

    # Loaded from its file: `import app` is the package, not the Spaces entry next to it.
    spec = importlib.util.spec_from_file_location("space_entry", Path(__file__).parent.parent / "app.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    reqs = tmp_path / "nodeps.txt"
    reqs.write_text("# comment\npytest==0.0.1  # wrong version\ngradio==6.31.0\n")
    assert entry.pinned(reqs) == [("pytest", "0.0.1"), ("gradio", "6.31.0")]
    assert entry.missing(entry.pinned(reqs)) == ["pytest==0.0.1"]
    calls = []
    monkeypatch.setattr(entry.subprocess, "check_call", calls.append)
    monkeypatch.delenv("SPACE_ID", raising=False)
    entry.install_nodeps()
    assert calls == []  # only on a Space


def test_run_tab_step_against_a_server_without_prompt_logprobs(tmp_path):
    """The Run tab's defaults (selector judge, tool relevance 0.5) on an `openai:` server without prompt
    log-probabilities: the judge is refused with a clean message, and with the logprob selector the step runs
    without tool relevance and says so (it used to fail the episode: the UI's progress wrapper hid the
    server's `supports_scoring`)."""
    from fake_openai import FakeOpenAIServer, kv_agent, serving

    from app.service.session import NO_RELEVANCE

    with FakeOpenAIServer(serving("fake", kv_agent)) as fake:
        demo = build_demo(db_path=str(tmp_path / "ui.db"))  # the real loader: `openai:` builds the remote policy
        _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
        try:
            c = Client(url, verbose=False)
            spec = f"openai:{fake.url}#fake?retries=2&backoff=0.01&timeout=10"
            defaults = form(task="mock:kv", model=spec, relevance=C.UI_DEFAULTS["relevance"],
                            selector=C.UI_DEFAULTS["selector"])
            assert defaults["relevance"] == 0.5 and defaults["selector"] == "judge"
            message, *_ = c.predict(**defaults, api_name="/step")
            assert "ea-msg-error" in message and "Selector judge needs prompt log-probabilities" in message
            assert demo.services.store.db["episodes"].count == 0

            message, status, chat, timeline, cards, state = c.predict(**{**defaults, "selector": "logprob"},
                                                                      api_name="/step")
            assert "ea-msg-error" not in message and NO_RELEVANCE in message
            assert timeline["choices"] and "set(" in timeline["choices"][0][0]
            [row] = demo.services.store.list_episodes()
            episode = demo.services.store.get_episode(row["id"])
            assert episode.status == "running" and len(episode.steps) == 1 and episode.settings.relevance == 0.0
            assert "relevance 0 ·" in status
            # the scripted server writes its calls free of the constraint: each form is dropped, and the model line
            # says so (a visible fallback, not a silent one)
            assert ("constraints not kept by the server (it refused or ignored vllm-lark, sglang-lark, gbnf, vllm, "
                    "openai, llama.cpp, sglang)") in status
        finally:
            close_demo(demo)


@pytest.mark.parametrize("model, expected", [("openai:http://127.0.0.1:8080/v1#m", C.NO_ADAPTER),
                                             (" openai:http://gpu:8000/v1#Qwen/Qwen3-8B", C.NO_ADAPTER),
                                             ("embedded", "fixtures/adapters/x"), ("hf:/models/m", "fixtures/adapters/x")])
def test_picking_a_served_model_clears_the_lora_adapter(model, expected):
    """A served model runs its server's weights: the Adapter box's default LoRA would refuse every step."""
    from app.service import forms

    assert forms.adapter_for_model(model, "fixtures/adapters/x", C.NO_ADAPTER) == expected


@pytest.mark.parametrize("trial", range(3))
def test_close_demo_sets_the_stop_event_on_the_servers_loop_while_streams_come_and_go(trial):
    """`close_demo` sets the app's stop event on the server's own event loop. Gradio's `close()` sets it from
    the calling thread while the loop adds and removes waiters (each open stream waits on it): under load that
    raised "RuntimeError: deque mutated during iteration" (a `make test` teardown with two workers; with this
    test's churn and a 1 us switch interval, plain `close()` raised it in 6 of 10 tries, `close_demo` in 0).
    Every waiter wakes and the port is freed."""
    import asyncio
    import socket
    import sys

    import gradio as gr

    with gr.Blocks() as demo:
        gr.Markdown("x")
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    port, event = demo.server_port, demo.app.stop_event
    loop = demo.server.servers[0].get_loop()  # the loop the server runs on (its own thread)

    async def churn() -> None:  # streams that open and close: waiters added and removed on the loop
        while not event.is_set():
            waiter = asyncio.ensure_future(event.wait())
            await asyncio.sleep(0)
            waiter.cancel()
            await asyncio.sleep(0)

    waiters = [asyncio.run_coroutine_threadsafe(event.wait(), loop) for _ in range(3000)]
    for _ in range(20):
        asyncio.run_coroutine_threadsafe(churn(), loop)
    wait_until(lambda: len(getattr(event, "_waiters", ())) >= 3000, 30, message="the waiters never parked")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: the race's window, wide open
    try:
        close_demo(demo)
    finally:
        sys.setswitchinterval(interval)
    assert all(w.result(timeout=10) is True for w in waiters)
    assert event.is_set()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
