"""Rehearsing stored episodes offline with the real embedded model (teacher-forced), and comparing world models.

The source episodes are real BFCL episodes (the ground-truth calls of multi_turn_base_0 executed in the real
environment: `expert_episode`), cut to a few calls to keep the model's work small (48-token predictions).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gradio_client import Client

from app import envs
from app.config import shipped_adapter
from app.engine.trace_rehearsal import NOT_EXECUTED_RECORDED, recorded_calls, rehearsal_id
from app.formats import call_text, canonical_json, short_json
from app.records import Annotation
from app.service.forms import InputError
from app.service.model_comparison import ALL_TOOLS, ModelRef, compare_models, comparison_figure, parse_models
from app.service.rehearsal import rehearse_episodes
from app.store import Store
from app.training.rows import expert_episode

pytestmark = pytest.mark.slow  # every test rehearses with the real embedded model (the `policies` fixture)

TOKENS = 48
SHIPPED = shipped_adapter()


class Spy:
    """The real policy, keeping every Rehearse prompt it was given (what the model read)."""

    def __init__(self, inner: Any) -> None:
        self.inner_policy = inner
        self.prompts: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner_policy, name)

    def rehearse(self, prompts, config):
        self.prompts += list(prompts)
        return self.inner_policy.rehearse(prompts, config)


class Failing(Spy):
    """A model server that fails at its first prediction."""

    def rehearse(self, prompts, config):
        import model_backend

        raise model_backend.RemoteError("server answered 503 Service Unavailable")


@pytest.fixture(scope="module")
def policies():
    import model_backend

    return {SHIPPED: model_backend.load_policy("embedded", adapter=SHIPPED),
            None: model_backend.load_policy("embedded", adapter=None)}


def _source(n_calls: int, suffix: str):
    """A real BFCL episode (multi_turn_base_0's ground truth, executed) cut to its first `n_calls` call steps."""
    ep = expert_episode(envs.load_task("bfcl:multi_turn_base_0"))
    steps = ep.steps[:n_calls]
    assert all(s.kind == "call" for s in steps)
    return ep.model_copy(update={"id": f"{ep.id}-{suffix}", "steps": steps, "turn_results": ep.turn_results[:1]})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = Store(tmp_path_factory.mktemp("rehearse") / "r.db")
    for ep in (_source(3, "three"), _source(1, "one")):
        store.replace_episode(ep)
    return store


THREE, ONE = "expert-bfcl:multi_turn_base_0-three", "expert-bfcl:multi_turn_base_0-one"


def _rehearse(store, policy, ids, adapter, **kw):
    return rehearse_episodes(store, ids, policy, model="embedded", adapter=adapter, max_rehearsal_tokens=TOKENS,
                             remember=store.add_transitions, **kw)


def test_rehearsal_predicts_every_recorded_call_teacher_forced(store, policies):
    # The base weights: the teacher-forcing check below needs a prediction that differs from the recorded response,
    # and the shipped adapter may get all three right.
    spy = Spy(policies[None])
    result = _rehearse(store, spy, [THREE], None)
    source = store.get_episode(THREE)
    rehearsal = store.get_episode(rehearsal_id(THREE, "embedded", None))
    assert result.rehearsals == [rehearsal.id] and result.calls == 3 and not result.replaced
    assert rehearsal.source_episode == THREE and rehearsal.model == "embedded" and rehearsal.adapter is None
    assert [s.index for s in rehearsal.steps] == [s.index for s in source.steps]
    for recorded, step in zip(source.steps, rehearsal.steps):
        b = step.chosen_branch
        assert len(step.branches) == 1 and b.chosen and b.actual_source == "committed"
        assert b.call == recorded.chosen_branch.call and canonical_json(b.actual) == canonical_json(
            recorded.chosen_branch.actual)
        assert b.predicted_text is not None and b.metrics.json_valid is not None
        assert b.metrics.exact is not None and b.metrics.field_f1 is not None and b.metrics.surprise is not None
        if b.metrics.json_valid:
            assert b.metrics.error_agree is not None
    assert rehearsal.rehearsals == 3 and rehearsal.success is None  # nothing ran: nothing to judge
    # Teacher-forced: each prompt shows the recorded calls before it with their recorded responses, never the
    # model's predictions of them.
    assert len(spy.prompts) == 3
    for i, prompt in enumerate(spy.prompts):
        text = "\n".join(m["content"] for m in prompt.messages)
        for earlier in rehearsal.steps[:i]:
            b = earlier.chosen_branch
            assert f"{call_text(b.call)} -> {short_json(b.actual, 200)}" in text
            if b.metrics.json_valid and not b.metrics.exact:
                assert f"{call_text(b.call)} -> {short_json(b.predicted, 200)}" not in text
    assert any(s.chosen_branch.metrics.json_valid and not s.chosen_branch.metrics.exact for s in rehearsal.steps[:2]), \
        "no earlier prediction differed from the recorded response: the teacher-forcing check above proved nothing"
    # The recorded results joined the rehearsal memory, tied to the source episode.
    remembered = [t for t in store.transitions() if t.episode_id == THREE]
    assert sorted(t.step for t in remembered) == [0, 1, 2] and {t.source for t in remembered} == {"committed"}
    # The Dashboard and Annotate read it as any episode.
    rows = [r for r in store.dashboard_branches(model="embedded") if r["episode_id"] == rehearsal.id]
    assert len(rows) == 3 and all(r["json_valid"] is not None for r in rows)
    queue = store.annotation_queue(episode_id=rehearsal.id)
    assert len(queue) == 3


def test_alternatives_are_rehearsed_without_an_actual_response(store, policies):
    result = _rehearse(store, policies[SHIPPED], [ONE], SHIPPED, alternatives=2)
    step = store.get_episode(result.rehearsals[0]).steps[0]
    recorded, others = step.branches[0], step.branches[1:]
    assert recorded.chosen and recorded.actual_source == "committed" and recorded.metrics.exact is not None
    # Two proposals (greedy, sampled); one equal to the recorded call folds into it as a duplicate, and two equal
    # to each other fold into one branch.
    assert len(others) + recorded.duplicates + sum(b.duplicates for b in others) == 2
    assert result.alternatives == len(others)
    for b in others:
        assert not b.chosen and b.actual is None and b.actual_source is None
        assert b.metrics.exact is None and b.metrics.field_f1 is None
        if b.kind == "call":
            assert b.not_executed == NOT_EXECUTED_RECORDED and b.predicted_text is not None


def test_rehearsing_again_replaces_and_an_annotated_rehearsal_is_kept_unless_allowed(store, policies):
    before = len(store.find_episodes(limit=1000))
    first = _rehearse(store, policies[SHIPPED], [ONE], SHIPPED)  # one already exists from the test above, or not
    again = _rehearse(store, policies[SHIPPED], [ONE], SHIPPED)
    assert again.rehearsals == first.rehearsals and again.replaced == again.rehearsals
    rehearsals = [r for r in store.find_episodes(limit=1000) if r.get("source_episode") == ONE
                  and r["adapter"] == SHIPPED]
    assert len(rehearsals) == 1
    assert len(store.find_episodes(limit=1000)) <= before + 1
    branch = store.branch_id_at(again.rehearsals[0], 0)
    store.add_annotation(Annotation(branch_id=branch, label="major", annotator="t"))
    with pytest.raises(InputError, match=r"has 1 annotation\(s\)"):
        _rehearse(store, policies[SHIPPED], [ONE], SHIPPED)
    assert len(store.annotations(branch)) == 1  # kept


def test_bad_input_and_a_failing_model_write_nothing(store, policies, capsys):
    from app.cli.main import main

    def counts():
        return {t: store.db[t].count for t in ("episodes", "steps", "branches")}

    before = counts()
    assert main(["rehearse", "--db", store.path, "--episodes", f"{THREE},nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: no episode with id nope"
    assert main(["rehearse", "--db", store.path, "--episodes", ONE, "--model", "nonsense:x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "nonsense" in err[0]
    assert main(["rehearse", "--db", store.path, "--episodes", ONE, "--alternatives", "9"]) == 2
    assert "0 to 8" in capsys.readouterr().err
    with pytest.raises(InputError, match=r"model failed while rehearsing episode .*503.*nothing of that episode"):
        rehearse_episodes(store, [THREE], Failing(policies[None]), model="embedded", adapter="other-adapter")
    assert counts() == before
    assert not store.list_episodes(id=rehearsal_id(THREE, "embedded", "other-adapter"))


def test_compare_two_adapters_per_tool_with_a_figure(store, policies, capsys):
    _rehearse(store, policies[SHIPPED], [THREE], SHIPPED)
    _rehearse(store, policies[None], [THREE], None)
    models = parse_models("embedded,embedded@none")
    assert models == [ModelRef("embedded", SHIPPED), ModelRef("embedded", None)]
    comparison = compare_models(store, [THREE], models)
    assert comparison.calls == 3
    tools = {s.chosen_branch.call.name for s in recorded_calls(store.get_episode(THREE))}
    assert {(r["tool"], r["model"]) for r in comparison.rows} == {
        (t, m.label) for t in tools | {ALL_TOOLS} for m in models}
    calls = [s.chosen_branch.call.name for s in recorded_calls(store.get_episode(THREE))]
    for r in comparison.rows:
        assert r["n"] == (3 if r["tool"] == ALL_TOOLS else calls.count(r["tool"]))
        assert all(r[m] is None or 0 <= r[m] <= 1 for m in ("exact", "field_f1", "error_agree"))
    fig = comparison_figure(comparison)
    assert {t.name for t in fig.data} == {m.label for m in models} and len(fig.data) == 2 * 3
    for d in comparison.disagreements:  # each opened with both models' predictions
        assert set(d.branches) == {m.label for m in models}
        assert len({canonical_json(b.predicted) if b.metrics.json_valid else b.predicted_text
                    for b in d.branches.values()}) == 2
    from app.cli.main import main

    assert main(["compare", "--db", store.path, "--episodes", THREE, "--models", "embedded,embedded@none",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calls"] == 3 and len(out["rows"]) == len(comparison.rows)
    assert len(out["disagreements"]) == len(comparison.disagreements)
    assert main(["compare", "--db", store.path, "--episodes", THREE, "--models", "embedded,embedded@missing"]) == 2
    assert "no rehearsal by embedded@missing" in capsys.readouterr().err


def test_traces_tab_rehearses_and_compares_through_the_app(store, policies):
    from app.ui import build_demo, close_demo

    for adapter in (SHIPPED, None):  # what the compare test rehearsed (when this test runs alone)
        if not store.list_episodes(id=rehearsal_id(THREE, "embedded", adapter)):
            _rehearse(store, policies[adapter], [THREE], adapter)
    demo = build_demo(db_path=store.path, policy_loader=lambda model, adapter: policies[adapter])
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        c = Client(url, verbose=False)
        message = c.predict([ONE], "embedded", "(none)", 0, api_name="/rehearse_episodes")
        assert "ea-msg-error" not in message and "Rehearsed 1 recorded call(s) in 1 episode(s)" in message
        assert store.list_episodes(id=rehearsal_id(ONE, "embedded", None))
        bad = c.predict(["nope"], "embedded", "(none)", 0, api_name="/rehearse_episodes")
        assert "ea-msg-error" in bad and "no episode with id nope" in bad
        table, figure, note, picked, *_ = c.predict([THREE], "embedded,embedded@none", api_name="/compare_models")
        assert "3 recorded call(s) compared across 2 models" in note
        assert {row[1] for row in table["data"]} == {f"embedded@{SHIPPED}", "embedded@none"}
        expected = compare_models(store, [THREE], parse_models("embedded,embedded@none")).disagreements
        # Greedy decoding: the shipped adapter and the bare model predicted these calls differently (the test above).
        assert expected, "the two models agreed on every call: nothing to open side by side"
        assert picked["choices"] == [[d.key, d.key] for d in expected] and picked["value"] == expected[0].key
        picked = picked["value"]
        html = c.predict(picked, api_name="/open_disagreement")
        assert f"embedded@{SHIPPED}" in html and "embedded@none" in html and html.count("ea-card-head") == 2
    finally:
        close_demo(demo)


def test_all_skips_what_cannot_be_rehearsed_and_says_why(tmp_path, capsys):
    from app.cli.main import main

    store = Store(tmp_path / "a.db")
    source = _source(1, "running")
    store.replace_episode(source.model_copy(update={"status": "running"}))
    answer_only = expert_episode(envs.load_task("bfcl:multi_turn_base_0"))
    answer_only = answer_only.model_copy(update={"id": "answers", "steps": [s for s in answer_only.steps
                                                                             if s.kind == "answer"][:1]})
    store.replace_episode(answer_only)
    assert main(["rehearse", "--db", store.path, "--all"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert sorted(err[:2]) == sorted([f"skipped: episode {source.id} is still running: rehearse it once it has ended",
                                      "skipped: episode answers has no recorded tool call with a response to rehearse"])
    assert err[2] == f"error: no episode to rehearse in {store.path}" and len(err) == 3
    assert store.db["episodes"].count == 2


def test_an_imported_trace_is_rehearsed_and_its_results_join_the_memory_as_imported(tmp_path, policies):
    from app.service.catalog import episode_task
    from app.trace_io import import_records, read_foreign

    root = Path(__file__).resolve().parent.parent / "fixtures" / "third_party"
    store = Store(tmp_path / "imported.db")
    import_records(store, read_foreign(root / "openai_chat.jsonl", "openai"))  # written by another library
    import_records(store, read_foreign(root / "smolagents_genai.jsonl", "otlp"))  # spans without results
    chat = next(r["id"] for r in store.find_episodes() if r["task_id"].startswith("trace:openai/"))
    result = _rehearse(store, policies[SHIPPED], [chat], SHIPPED)
    source, rehearsal = store.get_episode(chat), store.get_episode(result.rehearsals[0])
    assert rehearsal.source_episode == chat and rehearsal.trace == source.trace and result.calls >= 1
    for step in recorded_calls(rehearsal):
        assert step.chosen_branch.predicted_text is not None and step.chosen_branch.metrics.field_f1 is not None
    assert episode_task(rehearsal).id == source.task_id  # Annotate and Fine-tune rebuild its task as the source's
    remembered = [t for t in store.transitions() if t.episode_id == chat]
    assert len(remembered) == result.calls and {t.source for t in remembered} == {"imported"}
    no_result = next(r["id"] for r in store.find_episodes() if r["task_id"].startswith("trace:otlp/"))
    with pytest.raises(InputError, match="has no recorded tool call with a response"):
        _rehearse(store, policies[SHIPPED], [no_result], SHIPPED)
