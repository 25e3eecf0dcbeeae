"""Computing the next step ahead (`EpisodeRunner.compute_ahead`) while a person reads the last one: the step
then makes no model call, and is the step it would have computed; the episode does not change meanwhile."""
from __future__ import annotations

import json
import threading
from typing import Any

import pytest

import model_backend.policy as policy_module
from app import envs
from app.config import DEFAULT_RELEVANCE
from app.engine import EpisodeRunner
from app.envs.mock import MockEnvironment
from app.records import RunSettings
from app.service.catalog import RunRequest
from app.service.session import AheadStatus, RunSession, Services
from app.ui import render
from app.ui.run_callbacks import RunCallbacks, form_from_request
from model_backend import GenerationConfig, Prompt
from model_backend.policy import TransformersPolicy

pytestmark = pytest.mark.slow

SETTINGS = RunSettings(mode="parallel", branches=3, selector="logprob", seed=0, shadow=True, max_steps_per_turn=2,
                       max_action_tokens=40, max_rehearsal_tokens=40, relevance=DEFAULT_RELEVANCE)


@pytest.fixture
def model_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many generate and score passes the policy runs (kept results taken make none)."""
    calls = {"generate": 0, "score": 0}
    for name in calls:
        real = getattr(policy_module, name)

        def counted(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(policy_module, name, counted)
    return calls


def decisions(step: Any) -> list[tuple]:
    return [(b.action_text, b.kind, b.predicted_text, json.dumps(b.actual, sort_keys=True, default=str), b.chosen,
             b.metrics.exact if b.metrics else None) for b in step.branches]


def scores(step: Any) -> list[dict[str, float]]:
    return [dict(b.scores, surprise=b.metrics.surprise or 0.0 if b.metrics else 0.0) for b in step.branches]


def snapshot(runner: EpisodeRunner) -> tuple:
    return (json.dumps(runner.env.state(), sort_keys=True, default=str), list(runner.history),
            len(runner.episode.steps), runner.turn, runner._turn_open, list(runner.turn_executed), runner.done)


def test_a_step_computed_ahead_is_the_step_computed_then(shipped_policy: Any, model_calls: dict[str, int]) -> None:
    """Three steps of a held-out task (K=3, tools ranked with the channel, a turn budget of two steps): the first
    opens turn 0, the second continues it, the third opens turn 1 (the budget closed turn 0). Each is computed
    ahead on runner B while runner A computes it when stepped: B's step makes no model call and takes the same
    decisions; computing ahead leaves B's episode, history and environment as they were."""
    task_id = envs.list_tasks("multi_turn_base", "heldout")[1]
    plain = EpisodeRunner(envs.load_task(task_id), shipped_policy, SETTINGS)
    ahead = EpisodeRunner(envs.load_task(task_id), shipped_policy, SETTINGS)
    turns = []
    for _ in range(3):
        shipped_policy.reset_cache()
        shipped_policy.forget_scores(prompts=False)
        expected = plain.step()
        shipped_policy.reset_cache()
        shipped_policy.forget_scores(prompts=False)
        before = snapshot(ahead)
        model_calls.update(generate=0, score=0)
        assert ahead.compute_ahead() is True
        assert model_calls["generate"] >= 2 and model_calls["score"] >= 1  # Act and Rehearse, surprise at least
        assert snapshot(ahead) == before
        model_calls.update(generate=0, score=0)
        step = ahead.step()
        assert model_calls == {"generate": 0, "score": 0}
        assert decisions(step) == decisions(expected)
        for got, want in zip(scores(step), scores(expected)):
            assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-3 for k in got)
        turns.append(step.turn)
    assert turns == [0, 0, 1]
    assert ahead.history == plain.history and ahead.env.state() == plain.env.state()


def test_results_computed_ahead_are_taken_once(shipped_policy: Any, model_calls: dict[str, int]) -> None:
    prompt = Prompt([{"role": "user", "content": "Name a colour."}])
    config = GenerationConfig(max_new_tokens=6, temperature=0.8, seed=3)
    with shipped_policy.computing_ahead():
        ahead = [g.text for g in shipped_policy.act(prompt, 2, config)]
    assert model_calls["generate"] == 1
    assert [g.text for g in shipped_policy.act(prompt, 2, config)] == ahead and model_calls["generate"] == 1  # taken
    assert [g.text for g in shipped_policy.act(prompt, 2, config)] == ahead and model_calls["generate"] == 2  # computed
    other = GenerationConfig(max_new_tokens=6, temperature=0.8, seed=4)
    with shipped_policy.computing_ahead():
        shipped_policy.act(prompt, 2, other)
    shipped_policy.act(prompt, 2, config)  # another seed is another batch: computed
    assert model_calls["generate"] == 4
    shipped_policy.forget_scores(prompts=False)  # a benchmark's fresh start drops what was computed ahead
    shipped_policy.act(prompt, 2, other)
    assert model_calls["generate"] == 5


def test_computing_ahead_gives_way_and_refuses_what_cannot_pay(shipped_policy: Any, model_calls: dict[str, int]) -> None:
    task = envs.load_task(envs.list_tasks("multi_turn_base", "heldout")[0])
    runner = EpisodeRunner(task, shipped_policy, SETTINGS)
    before = snapshot(runner)
    cancel = threading.Event()
    cancel.set()
    assert runner.compute_ahead(cancel) is False  # cancelled before its first model call
    with shipped_policy._model():  # a step someone waits for holds the model: work ahead gives way at once
        assert runner.compute_ahead() is False
    assert model_calls == {"generate": 0, "score": 0} and snapshot(runner) == before
    # Forks that would reach a real backend, or a policy that keeps no results (weights in training): nothing.
    assert EpisodeRunner(task, shipped_policy, SETTINGS, env=MockEnvironment(forkable=False)).compute_ahead() is False
    training = TransformersPolicy(shipped_policy.loaded, prefix_cache_bytes=0, score_memo=0)
    assert EpisodeRunner(task, training, SETTINGS).compute_ahead() is False
    assert model_calls == {"generate": 0, "score": 0}
    runner.stop()
    assert runner.compute_ahead() is False


def test_the_run_tab_computes_the_next_step_while_the_person_reads(shipped_policy: Any, model_calls: dict[str, int],
                                                                   tmp_path: Any) -> None:
    """The Run tab's Step (its callback, as Gradio drives it) starts the next step's computation once its
    last view is out; the next Step then makes no model call. Reset stops that and prepares the task's first
    step in a new episode, which Step then takes. Services with it off start nothing."""
    services = Services(str(tmp_path / "ui.db"), policy_loader=lambda model, adapter: shipped_policy, compute_ahead=True)
    run = RunCallbacks(services)
    request = RunRequest(task_id=envs.list_tasks("multi_turn_base", "heldout")[2], model="embedded",
                         settings=SETTINGS)
    form = {**form_from_request(request), "instruction": "", "instruction_env": ""}
    session = RunSession()
    assert session.ahead_status() == AheadStatus("none") and run.ahead_line(session) == ""
    list(run.step(session, progress=lambda *a, **k: None, **form))
    assert session.episode is not None and len(session.episode.steps) == 1
    computing = session.ahead_status()  # the page's line, read while the person reads step 0
    assert computing.state == "computing" and computing.step == 1, computing
    assert run.ahead_line(session).startswith("Computing step 1 ahead")
    assert session.wait_ahead(timeout=300)
    ready = session.ahead_status()
    assert ready.state == "ready" and ready.step == 1 and ready.seconds > 0, ready
    assert run.ahead_line(session).startswith("✓ Step 1 is computed ahead")
    model_calls.update(generate=0, score=0)
    list(run.step(session, progress=lambda *a, **k: None, **form))
    assert len(session.episode.steps) == 2 and model_calls == {"generate": 0, "score": 0}
    second = session.episode.steps[1]  # its header says what its compute took ahead, not the 0.0 s at Step
    assert second.ahead_s > 0
    assert "computed ahead while the step before was read" in render.step_header(second)
    assert session.episode.steps[0].ahead_s == 0  # step 0 was computed when Step was pressed
    assert session.computing_ahead or session.runner.done  # the third step is on its way
    assert session.runner.done or session.ahead_status().step == 2
    first = session.episode.id
    run.reset(session, **form)  # stops that, and prepares the task's first step in a new episode
    assert session.wait_ahead(timeout=300)
    assert session.runner is not None and session.episode.id != first and not session.episode.steps
    assert session.ahead_status().state == "ready" and session.ahead_status().step == 0
    model_calls.update(generate=0, score=0)
    list(run.step(session, progress=lambda *a, **k: None, **form))
    assert len(session.episode.steps) == 1 and model_calls == {"generate": 0, "score": 0}
    session.reset(services)
    assert not session.computing_ahead and session.runner is None
    assert session.ahead_status() == AheadStatus("none") and run.ahead_line(session) == ""
    off = Services(str(tmp_path / "off.db"), policy_loader=lambda model, adapter: shipped_policy, compute_ahead=False)
    session.prepare(off, request)
    assert not session.computing_ahead and session.runner is None
    session.step(off, request)
    session.compute_ahead(off)
    assert not session.computing_ahead and session.ahead_status() == AheadStatus("none")


def test_a_failure_while_computing_ahead_is_logged_and_step_computes_the_step(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Engine flow only (a scripted policy, named as such): the work ahead raising leaves the session as it was."""
    from scripted import ScriptedPolicy

    scripted = ScriptedPolicy([['{"name": "get", "arguments": {"key": "a"}}'], ["Done."]])
    services = Services(str(tmp_path / "ui.db"), policy_loader=lambda model, adapter: scripted, compute_ahead=True)
    request = RunRequest(task_id=envs.MOCK_TASK_ID, model="scripted",
                         settings=RunSettings(mode="none", branches=1, selector="logprob"))
    session = RunSession()
    assert session.step(services, request) is not None

    def broken(self: EpisodeRunner, cancel: Any = None) -> bool:
        raise RuntimeError("fork failed")

    monkeypatch.setattr(EpisodeRunner, "compute_ahead", broken)
    with caplog.at_level("WARNING"):
        session.compute_ahead(services)
        assert session.wait_ahead(timeout=30)
    assert "computing the next step ahead failed" in caplog.text and "fork failed" in caplog.text
    assert session.ahead_status() == AheadStatus("none")  # the Run tab's line shows nothing, not "ready"
    assert session.step(services, request) is not None and len(session.episode.steps) == 2


def test_work_ahead_scores_in_slices_and_gives_way_between_them(shipped_policy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `computing_ahead`, `score` takes the model for about `AHEAD_SCORE_TOKENS` tokens at a time: a step
    that arrives meanwhile waits for one slice, and the slices done stay kept for it."""
    from model_backend.base import AheadStopped

    prompts = [Prompt([{"role": "user", "content": f"Describe item {i} in one word."}]) for i in range(20)]
    continuations = ["Blue."] * 20
    monkeypatch.setattr(policy_module, "AHEAD_SCORE_TOKENS", 5 * (len(shipped_policy.encode(prompts[0])) + 2))
    rows: list[int] = []
    real = policy_module.score
    arrive = [True]

    def scoring(model: Any, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        rows.append(len(prompt_ids))
        out = real(model, prompt_ids, *args, **kwargs)
        if arrive.pop() if arrive else False:
            shipped_policy._demand += 1  # a step someone waits for arrives during the first slice
        return out

    monkeypatch.setattr(policy_module, "score", scoring)
    shipped_policy.forget_scores(prompts=False)
    with pytest.raises(AheadStopped), shipped_policy.computing_ahead():
        shipped_policy.score(prompts, continuations)
    assert len(rows) == 1 and 3 <= rows[0] <= 6
    shipped_policy._demand -= 1
    kept = shipped_policy.score(prompts, continuations)  # the step: only the rows not scored ahead
    assert rows[1] == 20 - rows[0]
    shipped_policy.forget_scores(prompts=False)
    whole = shipped_policy.score(prompts, continuations)
    assert rows[-1] == 20
    assert all(abs(a - b) < 1e-3 for x, y in zip(kept, whole) for a, b in zip(x, y))
    # Rows under one prompt count it once: the tool ranking's names after one long Act prompt are one slice.
    shared = [prompts[0]] * 30
    rows.clear()
    with shipped_policy.computing_ahead():
        shipped_policy.score(shared, [f"name{i}" for i in range(30)])
    assert rows == [30]
