"""Interrupted episodes: found at the next start, continued where they stopped, or discarded.

A scripted policy drives the engine here (it never stands where the product uses a model);
the real process kill is in tests/test_kill.py.
"""
from __future__ import annotations

import json
import socket
import sqlite3
from pathlib import Path

import pytest

from app import envs
from app.engine import EpisodeRunner
from app.service import InputError, RunSession, Services
from app.records import Annotation, RunSettings
from app.store import Recorder, Store
from app.ui import constants as C
from app.ui.run_callbacks import RunCallbacks, form_from_request, request_from_form
from app.ui.traces_callbacks import TracesCallbacks
from scripted import ScriptedPolicy


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


SCRIPT = [[call("set", key="color", value="blue")], ["Stored."], [call("delete", key="size")],
          [call("get", key="color")], ["It is blue."]]
SETTINGS = RunSettings(mode="parallel", branches=1, selector="logprob", shadow=False)


def runner_after(n_steps: int, store: Store | None = None) -> EpisodeRunner:
    recorder = Recorder(store) if store is not None else None
    runner = EpisodeRunner(envs.mock_task(), ScriptedPolicy([list(s) for s in SCRIPT]), SETTINGS,
                           on_step=recorder)
    for _ in range(n_steps):
        runner.step()
    return runner


def test_a_dead_writers_running_episode_becomes_interrupted_and_a_live_ones_does_not(tmp_path: Path) -> None:
    store = Store(tmp_path / "t.db")
    ids = {}
    for writer in ("dead", "live", "elsewhere", "none"):
        runner = runner_after(1, store)
        ids[writer] = runner.episode.id
    host = socket.gethostname()
    with sqlite3.connect(tmp_path / "t.db") as conn:  # what a killed process, another host, an old version left
        conn.execute("update episodes set writer = ? where id = ?", (f"{host}:999999999", ids["dead"]))
        conn.execute("update episodes set writer = ? where id = ?", ("other-host:1", ids["elsewhere"]))
        conn.execute("update episodes set writer = null where id = ?", (ids["none"],))
    assert sorted(Store(tmp_path / "t.db").mark_interrupted()) == sorted([ids["dead"], ids["none"]])
    status = {w: store.get_episode(i).status for w, i in ids.items()}
    assert status == {"dead": "interrupted", "live": "running", "elsewhere": "running", "none": "interrupted"}
    assert len(store.get_episode(ids["dead"]).steps) == 1  # its complete steps are kept
    assert store.get_episode(ids["dead"]).end_reason == "interrupted"
    assert store.get_episode(ids["live"]).end_reason is None
    assert sqlite3.connect(tmp_path / "t.db").execute("pragma integrity_check").fetchone() == ("ok",)


def test_a_resumed_episode_carries_on_exactly_as_if_never_stopped() -> None:
    whole = runner_after(5)
    assert whole.done and whole.episode.success
    cut = runner_after(3)  # turn 0 judged, turn 1 open after its first call
    stored = cut.episode.model_copy(deep=True)
    stored.status = "interrupted"
    resumed = EpisodeRunner.resume(stored, envs.mock_task(), ScriptedPolicy([list(s) for s in SCRIPT[3:]]))
    assert resumed.turn == 1 and resumed.resume_mismatches == []
    assert [(h.role, h.content, h.result) for h in resumed.history] == \
           [(h.role, h.content, h.result) for h in cut.history]
    assert resumed.env.state() == cut.env.state()
    resumed.step()
    resumed.step()
    assert resumed.done and resumed.episode.id == cut.episode.id
    assert [t.model_dump() for t in resumed.episode.turn_results] == [t.model_dump() for t in whole.episode.turn_results]
    assert [s.chosen_branch.action_text for s in resumed.episode.steps] == \
           [s.chosen_branch.action_text for s in whole.episode.steps]


def loader(model: str, adapter: str | None) -> ScriptedPolicy:
    return ScriptedPolicy([list(s) for s in SCRIPT[3:]])


def test_continue_and_discard_from_the_traces_tab(tmp_path: Path) -> None:
    db = tmp_path / "ui.db"
    store = Store(db)
    cut = runner_after(3, store)
    with sqlite3.connect(db) as conn:
        conn.execute("update episodes set writer = ? where id = ?", (f"{socket.gethostname()}:999999999", cut.episode.id))
    services = Services(str(db), policy_loader=loader)  # a restarted server
    assert services.store.get_episode(cut.episode.id).status == "interrupted"
    traces, run = TracesCallbacks(services), RunCallbacks(services)

    session = RunSession()
    names = ["task", "model", "adapter", "mode", "branches", "selector", "source"]
    out = traces.continue_episode(cut.episode.id, session, names)
    assert "continues in the Run tab" in out[0]
    values = dict(zip(names, out[1:1 + len(names)]))
    assert values["task"] == envs.MOCK_TASK_ID and values["branches"] == 1 and values["adapter"] == C.NO_ADAPTER
    assert services.store.get_episode(cut.episode.id).status == "running"
    # The Run tab's form now reads back as the episode's request, so Step continues the same episode.
    form = {**form_from_request(session.request), "instruction": "", "instruction_env": ""}
    assert request_from_form(form).key == session.request.key
    for _ in range(2):
        list(run.step(session, progress=lambda *a, **k: None, **form))
    ep = services.store.get_episode(cut.episode.id)
    assert ep.status == "finished" and ep.success and len(ep.steps) == 5

    with pytest.raises(InputError, match="finished"):
        RunSession().resume(services, ep.id)
    message, plan, box, _ = traces.ask_discard(ep.id)
    assert "only an interrupted, stopped or failed" in message and plan is None and box.visible is False

    stopped = runner_after(1, services.store)
    stopped.stop()
    services.store.save_episode(stopped.episode)
    branch_id = services.store.branch_rows(stopped.episode.id)[0]["id"]
    services.store.add_annotation(Annotation(branch_id=branch_id, label="minor", annotator="t"))
    # Discard asks first, naming what goes; only the confirmation deletes.
    assert "Nothing to discard: press Discard first" in traces.discard_episode(None)[0]  # a confirm with no question
    assert "Pick an episode first" in traces.ask_discard(None)[0]
    message, plan, box, question = traces.ask_discard(stopped.episode.id)
    assert message == "" and box.visible is True
    assert stopped.episode.id in question and envs.MOCK_TASK_ID.replace("_", "\\_") in question
    assert "1 step and 1 annotation" in question
    assert services.store.get_episode(stopped.episode.id).status == "stopped"  # asking deleted nothing
    assert "kept" in traces.keep_episode(plan)[0] and services.store.annotations(branch_id)
    message, pending, box = traces.discard_episode(plan)
    assert "discarded" in message and "1 annotation" in message and pending is None and box.visible is False
    assert [r["id"] for r in services.store.list_episodes()] == [ep.id]
    assert services.store.annotations(branch_id) == []


def test_after_continue_another_task_in_the_form_starts_a_new_episode(tmp_path: Path) -> None:
    db = tmp_path / "ui.db"
    cut = runner_after(3, Store(db))
    cut.stop()
    Store(db).save_episode(cut.episode)
    services = Services(str(db), policy_loader=loader)
    session = RunSession()
    request = session.resume(services, cut.episode.id)
    other = request.__class__(task_id="bfcl:multi_turn_base_0", model=request.model, adapter=request.adapter,
                              settings=request.settings)
    session.ensure_runner(services, other)
    assert session.episode.id != cut.episode.id and session.episode.task_id == "bfcl:multi_turn_base_0"
    assert services.store.get_episode(cut.episode.id).status == "stopped"  # the continued one is saved, not lost


@pytest.mark.parametrize("tool_choice", C.TOOL_CHOICES)
def test_the_run_form_keeps_the_tool_choice(tool_choice: str) -> None:
    from app.service.catalog import RunRequest
    request = RunRequest(task_id=envs.MOCK_TASK_ID, settings=RunSettings(mode="none", branches=1, tool_choice=tool_choice))
    form = {**form_from_request(request), "instruction": "", "instruction_env": ""}
    assert form["tool_choice"] == tool_choice
    assert request_from_form(form).settings.tool_choice == tool_choice


def test_discard_refuses_what_it_may_not_delete_and_what_changed_since_it_asked(tmp_path: Path) -> None:
    from app.service import discard, plan_discard

    store = Store(tmp_path / "t.db")
    for missing in (None, ""):
        with pytest.raises(InputError, match="Pick an episode first"):
            plan_discard(store, missing)
    with pytest.raises(InputError, match="no episode with id nope"):
        plan_discard(store, "nope")
    running = runner_after(1, store)
    with pytest.raises(InputError, match="is running: only an interrupted, stopped or failed"):
        plan_discard(store, running.episode.id)
    running.stop()
    store.save_episode(running.episode)
    plan = plan_discard(store, running.episode.id)
    assert (plan.steps, plan.annotations, plan.status) == (1, 0, "stopped")
    branch_id = store.branch_rows(running.episode.id)[0]["id"]
    store.add_annotation(Annotation(branch_id=branch_id, label="match", annotator="t"))  # after the question
    with pytest.raises(InputError, match="changed since you asked .*1 annotation"):
        discard(store, plan)
    assert store.annotations(branch_id) and store.get_episode(running.episode.id).status == "stopped"
    again = plan_discard(store, running.episode.id)
    assert "1 step and 1 annotation" in again.question()
    assert "discarded" in discard(store, again)
    with pytest.raises(InputError, match="no episode"):
        plan_discard(store, running.episode.id)
