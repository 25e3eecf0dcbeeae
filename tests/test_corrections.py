"""Corrections a person can trust (issue 36): nothing lost, nothing malformed accepted, every episode trainable,
and a correction that enters the rehearsal memory the moment it is saved.

Real parts throughout (SQLite, BFCL's classes, the mock key-value environment, the engine's runner); the policy
is scripted (tests/scripted.py), since what is tested is the data path, not a model.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app import envs
from app.cli.main import main
from app.engine import EpisodeRunner
from app.engine.memory import MemoryScope, RehearsalMemory, corrected
from app.records import Annotation, Call, RunSettings, Transition
from app.service import Services
from app.service.annotations import annotated_episode_choices, save_annotation
from app.service.catalog import UnjudgedJudge, episode_task, instruction_task, task_env
from app.service.forms import InputError
from app.store import Recorder, Store
from app.trace_io import TraceFileError, export_episodes, import_records, parse_traces
from app.service import finetune as finetune_service
from app.formats import canonical_call, rehearse_target
from app.training.finetune import (CORRECTED, OTHERS, FinetuneError, FinetuneRequest, build_rows, select_corrections,
                                   summarize_unseen, trained_calls, unseen_probe, validate_request, wilson)
from app.training.rows import PromptContext, expert_episode
from app.ui import render
from app.ui.annotate_callbacks import AnnotateCallbacks, ReviewQueue
from scripted import ScriptedPolicy

REHEARSED = RunSettings(mode="parallel", branches=2, selector="logprob")
"""Every call rehearsed (a one-candidate script folds the second sample into the first)."""
FALSY = [None, "", 0, False, [], {}]
"""Corrected responses that are real corrections although they are "empty"."""


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def run_episode(store: Store, task, script: list[list[str]], *, env=None, judge=None,
                settings: RunSettings | None = None, memory: RehearsalMemory | None = None,
                predict=None) -> tuple[ScriptedPolicy, object]:
    policy = ScriptedPolicy([list(s) for s in script], predict=predict or (lambda text: {"ok": True}))
    recorder = Recorder(store)
    runner = EpisodeRunner(task, policy, settings or REHEARSED, on_step=recorder,
                           env=env, judge=judge, memory=memory)
    recorder.start(runner.episode)
    runner.run_all()
    recorder.flush(runner.episode)
    return policy, runner.episode


def kv_episode(store: Store, **kw) -> tuple[ScriptedPolicy, object]:
    """mock:kv: set(color) then get(color), then an answer."""
    return run_episode(store, envs.load_task(envs.MOCK_TASK_ID),
                       [[call("set", key="color", value="blue")], [call("get", key="color")], ["It is blue."]], **kw)


def branch_ids(store: Store, episode_id: str, kind: str = "call") -> list[int]:
    return [r["id"] for r in store.branch_rows(episode_id) if r["kind"] == kind]


def ctx(policy: ScriptedPolicy) -> PromptContext:
    return PromptContext(policy.count_tokens, policy.context_window)


@pytest.fixture
def kv(tmp_path: Path):
    store = Store(tmp_path / "c.db")
    policy, ep = kv_episode(store)
    return store, policy, ep


# ---------------------------------------------------------------- null, "", 0, false: corrections, kept


@pytest.mark.parametrize("value", FALSY + [{"value": "navy"}])
def test_a_falsy_corrected_response_is_saved_read_back_and_trained_on(kv, value) -> None:
    store, policy, ep = kv
    saved = save_annotation(store, branch_ids(store, ep.id)[1], "major", json.dumps(value), "", "", "tester")
    assert saved.annotation.corrected_predicted_set and saved.annotation.corrected_predicted == value
    (_, _, back), = store.annotations_by_position(ep.id)
    assert back.corrected_predicted_set and back.corrected_predicted == value
    (selected,) = select_corrections(store)  # a correction, not "annotated without one"
    rows = build_rows(store, [selected], ctx(policy))
    assert [(r.role, r.target) for r in rows] == [("rehearse", json.dumps(value) + "</execution_result>")]
    assert rows[0].prompt == policy.rehearse_calls[1][0]  # the very prompt the get call was rehearsed with


def test_an_empty_field_is_no_correction(kv) -> None:
    store, _, ep = kv
    saved = save_annotation(store, branch_ids(store, ep.id)[0], "match", "  ", "", "", "tester")
    assert not saved.annotation.corrected_predicted_set and not saved.annotation.corrected
    with pytest.raises(Exception, match="no corrected branches"):
        select_corrections(store)


def test_the_annotate_tab_saves_null_from_the_actual_response(tmp_path: Path) -> None:
    """The issue's case: a call whose real response is null, corrected from "Start from the actual response"."""
    services = Services(str(tmp_path / "ui.db"), lambda model, adapter: None, compute_ahead=False)
    task = instruction_task("Make a folder called notes.", "GorillaFileSystem")
    run_episode(services.store, task, [[call("mkdir", dir_name="notes")], ["Done."]],
                env=task_env(task), judge=UnjudgedJudge("Make a folder called notes."))
    cb = AnnotateCallbacks(services)
    queue = ReviewQueue()
    cb.load_queue(queue, False, False, "(all)", "(all)")
    assert queue.current == branch_ids(services.store, services.store.list_episodes()[0]["id"])[0]
    actual = cb.use_actual(queue)
    assert json.loads(actual) is None
    message, *_ = cb.save(queue, "major", actual, "", "", "tester")
    assert "Saved annotation" in message
    (row,) = services.store.annotations()
    assert row["corrected_predicted"] is None and row["corrected_predicted_set"] == 1
    assert services.store.annotation_records(row["branch_id"])[0].corrected
    existing = cb.prev(queue)[3]  # the branch's earlier annotations show the null, not nothing
    assert "corrected response" in existing and "null" in existing


# ---------------------------------------------------------------- malformed: a clear line, nothing saved


@pytest.mark.parametrize("response, action, answer, text", [
    ('{"value": ', "", False, "The corrected predicted response is not valid JSON (line 1, column 10"),
    ("nul", "", False, "not valid JSON"),
    ("", "mkdir notes", False, "The corrected action is not a tool call"),
    ("", call("rmdir", dir_name="x"), False, "unknown tool 'rmdir' (this step's tools: delete, fail, get, list_keys, set)"),
    ("", call("get", key=5), False, "invalid arguments for get: key: 5 is not of type 'string'"),
    ("", call("get"), False, "invalid arguments for get: 'key' is a required property"),
    ("", call("get", key="a", colour="b"), False, "unexpected argument(s) ('colour' was unexpected)"),
    ("", '<tool_call>{"name": </tool_call>', False, "The corrected action does not parse: invalid tool call"),
    ("", call("get", key="a"), True, "marked as a plain answer but is written as a tool call"),
])
def test_a_malformed_correction_is_one_line_and_saves_nothing(kv, response, action, answer, text) -> None:
    store, _, ep = kv
    with pytest.raises(InputError) as exc:
        save_annotation(store, branch_ids(store, ep.id)[1], "major", response, action, "", "tester", answer=answer,
                        remember=store.add_transitions)
    assert text in str(exc.value) and "\n" not in str(exc.value)
    assert store.annotations() == [] and store.transitions() == []


def test_a_valid_call_and_a_marked_answer_are_saved_with_their_kind(kv) -> None:
    store, policy, ep = kv
    ids = branch_ids(store, ep.id)
    as_call = save_annotation(store, ids[1], "major", "", call("get", key="size"), "", "tester")
    assert as_call.annotation.corrected_action_kind == "call"
    answer = branch_ids(store, ep.id, "answer")[0]
    as_answer = save_annotation(store, answer, "minor", "", "mkdir notes", "", "tester", answer=True)
    assert as_answer.annotation.corrected_action_kind == "answer"
    rows = build_rows(store, select_corrections(store), ctx(policy))
    assert [(r.role, r.target) for r in rows] == [("act", call("get", key="size")), ("act", "mkdir notes")]


def test_the_tab_keeps_the_fields_on_a_bad_action_and_saves_a_marked_answer(kv, tmp_path: Path) -> None:
    store, _, ep = kv
    services = Services(str(store.path), lambda model, adapter: None, compute_ahead=False)
    cb = AnnotateCallbacks(services)
    queue = ReviewQueue(ids=[branch_ids(store, ep.id, "answer")[0]])
    bad = cb.save(queue, "major", "", "mkdir notes", "", "tester", False)
    assert "not a tool call" in bad[0] and all(v is not None and not isinstance(v, str) for v in bad[1:])
    assert store.annotations() == []
    ok = cb.save(queue, "major", "", "mkdir notes", "", "tester", True)
    assert "Saved annotation" in ok[0]
    assert store.annotation_records(queue.ids[0])[0].corrected_action_kind == "answer"


# ---------------------------------------------------------------- rows written before the flag


def test_rows_written_before_the_flag_read_back(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    store = Store(path)
    policy, ep = kv_episode(store)
    ids = branch_ids(store, ep.id)
    store.db["annotations"].transform(drop={"corrected_predicted_set", "corrected_action_kind"})  # the old schema
    store.db["annotations"].insert_all([
        {"branch_id": ids[0], "label": "major", "corrected_predicted": '{"ok": false}', "annotator": "old",
         "created_at": "2026-01-01"},
        {"branch_id": ids[1], "label": "match", "corrected_predicted": None, "annotator": "old",
         "created_at": "2026-01-01"},
        {"branch_id": branch_ids(store, ep.id, "answer")[0], "label": "minor", "corrected_action": "It is navy.",
         "annotator": "old", "created_at": "2026-01-01"}])
    reopened = Store(path)  # adds the new columns, NULL in the old rows
    assert {"corrected_predicted_set", "corrected_action_kind"} <= set(reopened.db["annotations"].columns_dict)
    flags = [(a.corrected_predicted_set, a.corrected_predicted, a.corrected_action_kind)
             for _, _, a in reopened.annotations_by_position(ep.id)]
    assert flags == [(True, {"ok": False}, None), (False, None, None), (False, None, None)]
    rows = build_rows(reopened, select_corrections(reopened), ctx(policy))
    assert [(r.role, r.target) for r in rows] == [("rehearse", '{"ok": false}</execution_result>'),
                                                  ("act", "It is navy.")]


# ---------------------------------------------------------------- JSONL export / import, and the CLI


def test_export_import_keeps_a_null_correction_and_checks_actions(kv, tmp_path: Path) -> None:
    store, _, ep = kv
    save_annotation(store, branch_ids(store, ep.id)[1], "major", "null", "", "", "tester")
    out = tmp_path / "eps.jsonl"
    export_episodes(store, out)
    record = json.loads(out.read_text())
    assert record["annotations"][0]["corrected_predicted_set"] is True
    target = Store(tmp_path / "copy.db")
    import_records(target, parse_traces(out.read_bytes()))
    (_, _, back), = target.annotations_by_position(ep.id)
    assert back.corrected_predicted_set and back.corrected_predicted is None

    legacy = json.loads(out.read_text())  # a file written before the flag: a non-null value is set
    del legacy["annotations"][0]["corrected_predicted_set"]
    legacy["annotations"][0]["corrected_predicted"] = {"value": "navy"}
    (rec,) = parse_traces(json.dumps(legacy).encode())
    assert rec.annotations[0].corrected_predicted_set

    for action, text in [(call("rmdir", dir_name="x"), "unknown tool 'rmdir'"),
                         (call("get", key=5), "key: 5 is not of type 'string'"),
                         ("mkdir notes", "not a tool call")]:
        bad = json.loads(out.read_text())
        bad["annotations"][0]["corrected_action"] = action
        with pytest.raises(TraceFileError) as exc:
            parse_traces(json.dumps(bad).encode())
        assert text in str(exc.value) and str(exc.value).startswith("line 1: episode")
    answer = json.loads(out.read_text())
    answer["annotations"][0].update(corrected_action="mkdir notes", corrected_action_kind="answer")
    assert parse_traces(json.dumps(answer).encode())[0].annotations[0].corrected_action_kind == "answer"


def test_the_cli_annotates_and_exports_a_null_correction(kv, tmp_path: Path, capsys) -> None:
    store, _, ep = kv
    db = str(store.path)
    base = ["annotate", "--db", db, "--episode", ep.id, "--annotator", "cli"]
    assert main([*base, "--step", "1", "--action", "mkdir notes"]) == 2
    err = capsys.readouterr().err
    assert "not a tool call" in err and "pass --answer" in err and "Nothing was saved" in err and err.count("\n") == 1
    assert store.annotations() == []
    assert main([*base, "--step", "1", "--label", "major", "--response", "null"]) == 0
    assert "joined the rehearsal memory" in capsys.readouterr().out
    (row,) = store.annotations()
    assert row["corrected_predicted_set"] == 1 and row["corrected_predicted"] is None
    (t,) = store.transitions()
    assert (t.source, t.tool, t.arguments, t.response) == ("correction", "get", {"key": "color"}, None)


# ---------------------------------------------------------------- typed instructions train like benchmark episodes


def instruction_episode(store: Store, text: str = "Make a folder called notes.") -> tuple[ScriptedPolicy, object]:
    task = instruction_task(text, "GorillaFileSystem")
    return run_episode(store, task, [[call("mkdir", dir_name="notes")], ["Done."]], env=task_env(task),
                       judge=UnjudgedJudge(text), predict=lambda t: {"error": "exists"})


def test_a_typed_instruction_trains_on_its_rebuilt_prompts(tmp_path: Path) -> None:
    store = Store(tmp_path / "i.db")
    policy, ep = instruction_episode(store)
    assert episode_task(store.get_episode(ep.id)).turns == [[{"role": "user", "content": "Make a folder called notes."}]]
    save_annotation(store, branch_ids(store, ep.id)[0], "major", "null", call("mkdir", dir_name="notes2"), "",
                    "tester")
    rows = build_rows(store, select_corrections(store), ctx(policy))
    assert [(r.role, r.target) for r in rows] == [("act", call("mkdir", dir_name="notes2")),
                                                  ("rehearse", "null</execution_result>")]
    assert rows[0].prompt.messages == policy.act_calls[0][0].messages  # the prompt the agent acted on
    assert rows[1].prompt == policy.rehearse_calls[0][0]
    (label, value), = annotated_episode_choices(store)
    assert value == ep.id and label.startswith("instruction on GorillaFileSystem: “Make a folder called notes.”")


def test_what_cannot_be_rebuilt_is_left_out_with_a_note_and_the_rest_trains(tmp_path: Path) -> None:
    store = Store(tmp_path / "mixed.db")
    _, typed = instruction_episode(store)
    policy, bench = kv_episode(store)
    save_annotation(store, branch_ids(store, typed.id)[0], "major", "null", "", "", "tester")
    save_annotation(store, branch_ids(store, bench.id)[1], "major", '{"value": "navy"}', "", "", "tester")
    store.db["episodes"].update(typed.id, {"turn_results": "[]"})  # its instruction's text is not recorded
    notes: list[str] = []
    rows = build_rows(store, select_corrections(store), ctx(policy), notes)
    assert [r.ref.split("/")[0] for r in rows] == [bench.id]
    assert len(notes) == 1 and typed.id in notes[0] and "text was never recorded" in notes[0]
    plan = finetune_service.plan(store, None, False)
    assert plan.rehearse_rows == 1 and plan.left_out == notes


# ---------------------------------------------------------------- part 5: corrections feed the memory at once


def test_a_correction_ranks_above_an_observed_transition_of_the_same_call() -> None:
    get = Call(name="get", arguments={"key": "color"})
    seen = Transition(tool="get", arguments=get.arguments, response={"value": "blue"}, source="committed",
                      task_id="mock:kv", episode_id="a")
    fixed = corrected(get, {"value": "navy"}, tool=None, task_id="mock:kv", split=None, episode_id="b", step=1,
                      branch=0)
    other = Transition(tool="get", arguments={"key": "size"}, response={"value": 3}, source="correction",
                       task_id="mock:kv", episode_id="b")
    memory = RehearsalMemory(None, [seen, other, fixed])
    hits = memory.retrieve(get, MemoryScope("online", "mock:kv", "c"), 3)
    assert [(h.source, h.response) for h in hits] == [("correction", {"value": "navy"}),
                                                      ("committed", {"value": "blue"}),
                                                      ("correction", {"value": 3})]


def test_a_saved_correction_is_retrieved_by_the_next_rehearsal_of_that_call(tmp_path: Path) -> None:
    store = Store(tmp_path / "m.db")
    memory = RehearsalMemory(store)
    settings = REHEARSED.model_copy(update={"memory": "online", "memory_k": 2})
    _, first = kv_episode(store, settings=settings, memory=memory)  # rehearses get(color) as {"ok": true}
    get_branch = branch_ids(store, first.id)[1]
    assert [t.source for t in memory.transitions()] == ["committed", "committed"]  # what episode 1 observed
    saved = save_annotation(store, get_branch, "major", '{"value": "navy"}', "", "", "tester", remember=memory.add)
    assert saved.remembered is not None and saved.remembered.id is not None  # in the store and the memory
    assert any(t.source == "correction" for t in Store(store.path).transitions())

    policy, second = kv_episode(store, settings=settings, memory=memory)
    branch = second.steps[1].chosen_branch
    assert [(h.source, h.response) for h in branch.memory] == [("correction", {"value": "navy"}),
                                                               ("committed", {"value": "blue"})]
    prompt = policy.rehearse_calls[1][0].messages[-1]["content"]
    assert '"navy"' in prompt  # the rehearsal was conditioned on it
    card = render.memory_provenance(branch)
    assert "1 of them an annotator's correction" in card and "exact call" in card and "navy" in card


# ---------------------------------------------------------------- part 2: before/after on calls never trained on


def test_the_unseen_probe_holds_no_trained_call_and_splits_by_tool() -> None:
    counting = PromptContext(lambda text: len(text) // 4 + 1, 32768)
    first = unseen_probe(counting, {"cd", "mkdir"}, set(), 40, seed=0)
    assert first[CORRECTED] and all(tool in {"cd", "mkdir"} for tool, _ in first[CORRECTED])
    assert len(first[OTHERS]) == 40 and all(tool not in {"cd", "mkdir"} for tool, _ in first[OTHERS])
    assert all(row.role == "rehearse" and row.source == "expert" for _, row in first[CORRECTED] + first[OTHERS])
    again = unseen_probe(counting, {"cd", "mkdir"}, set(), 40, seed=0)
    assert [r.ref for _, r in again[OTHERS]] == [r.ref for _, r in first[OTHERS]]  # a fixed sample
    # A transition the fine-tune trained on is not unseen: trained, it leaves the probe.
    trained_ref, trained_row = first[CORRECTED][0][1].ref, first[CORRECTED][0][1]
    episode = expert_episode(envs.load_task(trained_ref.split("/")[0].removeprefix("expert-")))
    trained = (canonical_call(episode.steps[int(trained_ref.split("/")[1])].branches[0].call), trained_row.target)
    without = unseen_probe(counting, {"cd", "mkdir"}, {trained}, 40, seed=0)
    assert trained_ref not in {r.ref for _, r in without[CORRECTED]}
    assert len(without[CORRECTED]) == len(first[CORRECTED]) - 1


def test_an_argument_free_call_is_measured_in_every_state_it_was_called_in() -> None:
    """`ls()` answers with the folder it runs in: its calls are one canonical call but many transitions. A fine-tune
    that trained on one of them still has the others to be measured on."""
    counting = PromptContext(lambda text: len(text) // 4 + 1, 32768)
    episodes: dict[str, Any] = {}

    def transitions(rows: list) -> list[tuple[str, str]]:
        out = []
        for _, row in rows:
            task_id, step = row.ref.removeprefix("expert-").split("/")[:2]
            episode = episodes.setdefault(task_id, expert_episode(envs.load_task(task_id)))
            out.append((canonical_call(episode.steps[int(step)].branches[0].call), row.target))
        return out

    probe = transitions(unseen_probe(counting, {"ls"}, set(), 100, seed=0)[CORRECTED])
    by_call: dict[str, set[str]] = {}
    for call_key, target in probe:
        by_call.setdefault(call_key, set()).add(target)
    key, targets = max(by_call.items(), key=lambda kv: len(kv[1]))
    assert len(targets) >= 2, by_call  # one argument-free call, several responses: each is measured
    trained = (key, sorted(targets)[0])
    left = transitions(unseen_probe(counting, {"ls"}, {trained}, 100, seed=0)[CORRECTED])
    assert trained not in left and len(left) == len(probe) - 1
    assert {t for c, t in left if c == key} == targets - {trained[1]}


def test_trained_calls_are_the_corrected_branches_calls(kv) -> None:
    store, _, ep = kv
    ids = branch_ids(store, ep.id)
    save_annotation(store, ids[1], "major", "null", "", "", "tester")
    save_annotation(store, ids[0], "major", "", call("delete", key="size"), "", "tester")
    tools, trained = trained_calls(store, select_corrections(store))
    assert tools == {"get", "delete"}
    # Only the corrected response trains a Rehearse row (the corrected action trains an Act row).
    assert trained == {(canonical_call(Call(name="get", arguments={"key": "color"})), rehearse_target(None))}


def test_the_verdict_names_each_corrected_tool_and_the_others_with_an_interval() -> None:
    # The summary reads only each row's ref.
    probe = {CORRECTED: [("cd", SimpleNamespace(ref="a")), ("cd", SimpleNamespace(ref="b"))],
             OTHERS: [("ls", SimpleNamespace(ref="c")), ("cat", SimpleNamespace(ref="d"))]}
    before = {CORRECTED: [(False, 1.0), (True, 0.5)], OTHERS: [(True, 0.2), (False, 0.4)]}
    after = {CORRECTED: [(True, 0.3), (True, 0.1)], OTHERS: [(False, 0.3), (True, 0.3)]}
    summary = summarize_unseen(probe, before, after)
    assert summary["by_tool"]["cd"]["n"] == 2 and summary["by_tool"]["cd"]["after"]["rehearse_nll"] == 0.2
    assert summary["verdict"] == ("Rehearse exact, cd: 0.50 -> 1.00 on 2 unseen calls; "
                                  "other tools 0.50 -> 0.50 on 2 (after: 95% CI 0.09-0.91)")
    assert wilson(0, 10) == (0.0, 0.2775)
    metrics = {"before": {"rehearse_nll": 1.0}, "after": {"rehearse_nll": 0.5}, "unseen": summary}
    labels = [r[0] for r in finetune_service.comparison_rows(metrics)]
    assert labels[0] == "trained on (the corrections)"
    assert {"unseen cd calls (n=2)", "unseen other tools (n=2)"} <= set(labels)
    with pytest.raises(FinetuneError, match="unseen calls must be between 0 and 200"):
        validate_request(FinetuneRequest(out=Path("/nonexistent/new"), unseen_rows=500))


class RecordingRehearser:
    """A scripted policy (a unit test of the scoring loop, not a model): answers each Rehearse prompt with the text
    scripted for it and records every batch with its token budget."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers, self.batches, self.calls = answers, [], []

    def rehearse(self, prompts: list[Any], config: Any) -> list[Any]:
        self.batches.append((config.max_new_tokens, [p.messages[0]["content"] for p in prompts]))
        self.calls.append(("rehearse", [p.messages[0]["content"] for p in prompts]))
        return [SimpleNamespace(text=self.answers[p.messages[0]["content"]]) for p in prompts]

    def score(self, prompts: list[Any], continuations: list[str]) -> list[list[float]]:
        self.calls.append(("score", [p.messages[0]["content"] for p in prompts]))
        return [[-0.5] * (1 + int(p.messages[0]["content"].split()[1])) + [-1.0 - len(c)] for p, c in
                zip(prompts, continuations)]


def test_unseen_scores_decode_rows_of_one_budget_together_and_keep_each_rows_result() -> None:
    """Rows of one token budget decode together, each batch's targets are scored right after its decode (the
    prompts' KV is then in the policy's prefix cache), and each row keeps its own exact and NLL."""
    from app.training.finetune import SCORE_BATCH, rehearse_budget, rehearse_measure
    from model_backend.base import Prompt

    n = SCORE_BATCH + 3
    rows = [SimpleNamespace(prompt=Prompt([{"role": "user", "content": f"call {i}"}]),
                            target=f'<execution_result>{{"i": {i}}}</execution_result>') for i in range(n)]
    encoded = [SimpleNamespace(n_target=300 if i == 5 else 10) for i in range(n)]  # row 5 needs a larger budget
    answers = {f"call {i}": (f'{{"i": {i}}}</execution_result>' if i % 3 else
                             ('{"i": -1}</execution_result>' if i % 2 else "{not json"))
               for i in range(n)}
    policy = RecordingRehearser(answers)
    measured = rehearse_measure(policy, rows, encoded, "<eot>")
    assert [e for e, _ in measured] == [bool(i % 3) for i in range(n)]
    # the scripted score: i + 1 tokens at -0.5 and the last at -(1 + len(target + eot))
    for i, (_, nll) in enumerate(measured):
        assert nll == pytest.approx((0.5 * (i + 1) + 1 + len(rows[i].target + "<eot>")) / (i + 2))
    assert [kind for kind, _ in policy.calls] == ["rehearse", "score"] * (len(policy.calls) // 2)
    assert all(policy.calls[j][1] == policy.calls[j + 1][1] for j in range(0, len(policy.calls), 2))
    budgets = [b for b, _ in policy.batches]
    assert sorted(set(budgets)) == [128, rehearse_budget(encoded[5])] and rehearse_budget(encoded[5]) > 128
    assert all(len(p) <= SCORE_BATCH for _, p in policy.batches)
    assert [p for b, p in policy.batches if b > 128] == [["call 5"]]  # alone with its own budget
    assert sorted(x for _, p in policy.batches for x in p) == sorted(answers)  # every row once
    assert len(policy.batches) == 3  # 10 rows of budget 128 in two batches, row 5 in its own
