"""Training: rows match the engine's prompts, atomic adapter saves, fine-tune validation and a real fine-tune.

Fast tests use the scripted policy and the mock environment; tests marked `slow` load the
real embedded model (about a minute in all on 2 cores).
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest

from app import envs
from app.cli.main import main
from app.config import DEFAULT_RELEVANCE
from app.engine import EpisodeRunner
from app.training.finetune import FinetuneError, FinetuneRequest, run_finetune, select_corrections, validate_request
from app.records import Annotation, RunSettings
from app.store import Recorder, Store
from app.formats import canonical_json, rehearse_target
from app.engine.replay import replay, replay_ground_truth
from app.training.rows import (ANSWER_CHARS, FINAL_ANSWER, PromptContext, act_row_prompt, answer_values,
                               episode_rows, expert_episode, final_answer, mentions, self_training_rows)
from app.training.memory_seed import argument_pool, task_transitions
from app.envs.base import ToolResult
from app.training.agent import forced_answers
from model_backend.base import Generation
from model_backend.training import TrainConfig, TrainingError, save_adapter
from scripted import ScriptedPolicy, branch_ids, call, mock_episode, stored_mock_episode


def ctx_for(policy) -> PromptContext:
    return PromptContext(policy.count_tokens, policy.context_window)


# ---- rows match what the engine renders ------------------------------------------------------------


@pytest.mark.parametrize("settings", [RunSettings(mode="parallel", branches=2, selector="logprob"),
                                      RunSettings(mode="none", branches=1, tool_choice="required"),
                                      RunSettings(mode="none", branches=1, tool_choice="first"),
                                      RunSettings(mode="parallel", branches=2, selector="logprob",
                                                  rehearsal_context="history+state")])
def test_replayed_prompts_equal_the_engine_prompts(settings: RunSettings) -> None:
    task, policy, ep = mock_episode(settings)
    rows = episode_rows(ep, task, ctx_for(policy), source="self")
    ctx = ctx_for(policy)
    ctx.settings = settings
    replayed = [act_row_prompt(view, ctx) for view in replay(ep, task)]
    assert replayed == [p for p, _ in policy.act_calls] and len(replayed) == len(ep.steps)
    rehearsed = [p for batch in policy.rehearse_calls for p in batch]
    for r in (r for r in rows if r.role == "rehearse"):
        assert r.prompt in rehearsed or settings.mode == "none"
    act = [r for r in rows if r.role == "act"]
    if settings.tool_choice == "required":
        assert all(not r.target.startswith("<tool_call>") for r in act)
    if settings.tool_choice == "first":  # the first step of each turn calls; the answers after stay whole
        assert [r.prompt.prefill for r in act] == ["<tool_call>", "", "<tool_call>", "", ""]
        assert [r.target for r in act if not r.prompt.prefill] == ["Stored.", call("get", key="color"), "It is blue."]


def test_self_training_turns_a_shadow_write_into_a_rehearse_row() -> None:
    # Two steps, so the shadow write's history is not empty: a read, then set (committed) vs delete (shadow).
    script = [[call("list_keys")], [call("set", key="color", value="blue"), call("delete", key="size")]]
    policy = ScriptedPolicy(script, predict=lambda text: {"ok": True})
    runner = EpisodeRunner(envs.load_task("mock:kv"), policy,
                           RunSettings(mode="parallel", branches=2, selector="logprob"))
    runner.step()
    step = runner.step()
    committed, shadow = step.branches
    assert committed.chosen and shadow.call.name == "delete" and shadow.actual_source == "shadow"
    rows = self_training_rows([runner.episode], ctx_for(policy))
    rehearse = {r.ref: r for r in rows if r.role == "rehearse"}
    ep_id = runner.episode.id
    row = rehearse[f"{ep_id}/1/1"]
    assert row.source == "self" and row.target == rehearse_target({"deleted": "size"})
    engine = policy.rehearse_calls[1][1]  # the prompt the engine rehearsed it with
    assert (row.prompt.messages, row.prompt.prefill) == (engine.messages, engine.prefill)
    # Built as for the committed call of that step: the same history, before the step.
    assert row.prompt.messages[:-1] == rehearse[f"{ep_id}/1/0"].prompt.messages[:-1]


def test_expert_episode_replays_ground_truth_and_ends_turns() -> None:
    task = envs.load_task("bfcl:multi_turn_base_0")
    ep = expert_episode(task)
    assert ep.success and all(t.success for t in ep.turn_results)
    gold = sum(len(t) for t in task.ground_truth)
    assert len(ep.steps) == gold + len(task.turns)
    rows = episode_rows(ep, task, PromptContext(lambda t: max(1, len(t) // 4), 8192), source="expert")
    acts = [r for r in rows if r.role == "act"]
    answers = [r.target for r in acts if not r.target.startswith("<tool_call>")]
    assert len(acts) == len(ep.steps) and len(answers) == len(task.turns)
    assert all(a.startswith("Done") for a in answers)
    assert sum(r.role == "rehearse" for r in rows) == gold
    # A later prompt extends the earlier one: the history holds the call and its real result.
    views = list(replay(ep, task))
    assert views[1].history[-1].role == "tool" and views[1].history[-1].result == ep.steps[0].branches[0].actual


def test_a_turns_answer_reports_what_its_real_results_say() -> None:
    """The expert's answer at a turn's end is built from the turn's real results: a question turn's answer carries
    the data its read-only calls returned, a turn of writes says what the last write answered, a turn whose calls
    returned nothing is the plain reply; every answer fits its budget."""
    golds_by_turn: list[list] = []
    for task_id in envs.list_tasks("multi_turn_base", "train")[:12]:
        task = envs.load_task(task_id)
        env = envs.make_env(task)
        golds_by_turn += [list(replay_ground_truth(task, env, turn)) for turn in range(len(task.ground_truth))]
    kinds = set()
    for golds in golds_by_turn:
        answer, values = final_answer(golds), answer_values(golds)
        assert len(answer) <= ANSWER_CHARS and "\n\n" not in answer
        if values:  # a question turn: the read-only data is in the answer
            kinds.add("question")
            assert mentions(answer, values), (answer, values)
        elif any(g.result.output not in (None, {}, [], "") for g in golds):
            kinds.add("writes")
            last = [g for g in golds if g.result.output not in (None, {}, [], "")][-1]
            assert answer.startswith(f"Done. {last.name} returned"), answer
        else:
            kinds.add("nothing")
            assert answer == FINAL_ANSWER
    assert kinds == {"question", "writes", "nothing"}
    # A result too long for the budget is cut, and a failed call says so.
    task = envs.load_task("bfcl:multi_turn_base_0")
    gold = next(replay_ground_truth(task, envs.make_env(task), 0))
    long = replace(gold, result=ToolResult({"error": "x" * 500}, error=True))
    assert final_answer([long]).startswith(f"Done. {gold.name} failed: error: xxx")
    assert len(final_answer([long])) == ANSWER_CHARS and final_answer([long]).endswith("...")


def test_an_expert_episode_can_explore_calls_on_forks_and_they_become_rehearse_rows_only() -> None:
    """`expert_episode(explore=1)`: before each gold call a sampled call runs on a fork of the state it meets; it is
    kept as an unchosen branch with its real response (errors included) and becomes a Rehearse row with source
    `explore`, never an Act row; the gold replay, its states and the judge's verdict are unchanged; the draw is
    fixed per task and seed."""
    ids = envs.list_tasks("multi_turn_base", "train")[:20]
    pool = argument_pool(ids)
    task = envs.load_task(ids[0])
    plain, explored = expert_episode(task), expert_episode(task, 1, pool)
    assert explored.success == plain.success is True
    assert [(s.chosen_branch.action_text, s.state_before) for s in explored.steps] == [
        (s.chosen_branch.action_text, s.state_before) for s in plain.steps]
    extra = [(s, b) for s in explored.steps for b in s.branches if not b.chosen]
    assert extra and all(b.actual_source == "shadow" and b.call is not None for _, b in extra)
    assert explored.shadow_calls == len(extra)
    # Each explored response is what its call really returns on the state the gold call met.
    calls = [s for s in explored.steps if s.kind == "call"]
    env, seen = envs.make_env(task), []

    def check(gold) -> None:
        step = calls[len(seen)]
        seen.append([env.fork().call(b.call.name, b.call.arguments).output == b.actual
                     for b in step.branches if not b.chosen])

    for turn in range(len(task.ground_truth)):
        list(replay_ground_truth(task, env, turn, before=check))
    assert len(seen) == len(calls) and all(all(ok) for ok in seen)
    assert all(b.action_text != s.chosen_branch.action_text for s, b in extra)
    errors = sum(bool(b.actual_error) for ep_id in ids[:8]
                 for s in expert_episode(envs.load_task(ep_id), 1, pool).steps for b in s.branches if not b.chosen)
    assert errors > 0
    ctx = PromptContext(lambda t: max(1, len(t) // 4), 8192)
    rows = episode_rows(explored, task, ctx, source="expert")
    assert sorted(r.ref for r in rows if r.source == "explore") == sorted(
        f"{explored.id}/{s.index}/{b.index}" for s, b in extra)
    assert all(r.role == "rehearse" for r in rows if r.source == "explore")
    assert [r for r in rows if r.role == "act"] == [r for r in episode_rows(plain, task, ctx, source="expert")
                                                    if r.role == "act"]
    assert [b.action_text for s in expert_episode(task, 1, pool).steps for b in s.branches] == [
        b.action_text for s in explored.steps for b in s.branches]


class AnsweringScript(ScriptedPolicy):
    """A scripted policy (a unit test of the measurement, not a model): `act_each` writes `answer(prompt)`."""

    def __init__(self, answer) -> None:
        super().__init__([])
        self.answer = answer

    def act_each(self, prompts, config):
        return [Generation(text=self.answer(p), token_logprobs=[-0.1], sampled=False) for p in prompts]


def test_forced_answers_count_answers_that_carry_the_data_of_question_turns() -> None:
    ids = envs.list_tasks("multi_turn_base", "heldout")[:3]
    echo = forced_answers(AnsweringScript(lambda p: "Done. " + " ".join(str(m["content"]) for m in p.messages[1:]
                                                                     if m["role"] not in ("system", "assistant"))),
                          ids)
    fixed = forced_answers(AnsweringScript(lambda p: FINAL_ANSWER), ids)
    calls = forced_answers(AnsweringScript(lambda p: call("ls")), ids)
    turns = sum(len(envs.load_task(t).turns) for t in ids)
    assert echo["turns"] == fixed["turns"] == calls["turns"] == turns
    assert 0 < echo["question_turns"] < turns and echo["question_turns"] == fixed["question_turns"]
    assert (echo["answered"], echo["mentions"], echo["constant"]) == (1.0, 1.0, 0)
    assert (fixed["answered"], fixed["mentions"], fixed["constant"]) == (1.0, 0.0, turns)
    assert (calls["answered"], calls["mentions"]) == (0.0, 0.0)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_state_share_gives_that_share_of_rehearse_rows_the_state_of_the_tools_class(share: float) -> None:
    task = envs.load_task("bfcl:multi_turn_base_0")
    ep = expert_episode(task)
    ctx = PromptContext(lambda t: max(1, len(t) // 4), 8192, state_share=share)
    rows = [r for r in episode_rows(ep, task, ctx, source="expert") if r.role == "rehearse"]
    shown = [r for r in rows if "Environment state (GorillaFileSystem):" in r.prompt.messages[-1]["content"]]
    if share == 0.0:
        assert not shown
    elif share == 1.0:
        assert len(shown) == len(rows) > 0
    else:
        assert 0 < len(shown) < len(rows)
    # The state shown is the step's own state before the call, not the episode's last one; the draw is per row,
    # so a second build gives the same prompts.
    steps = {s.index: s for s in ep.steps}
    for r in shown:
        state = steps[int(r.ref.split("/")[1])].state_before["GorillaFileSystem"]
        assert canonical_json(state)[:200] in r.prompt.messages[-1]["content"]
    again = [r for r in episode_rows(ep, task, ctx, source="expert") if r.role == "rehearse"]
    assert [r.prompt for r in again] == [r.prompt for r in rows]



def test_expert_episodes_and_the_memory_seed_share_one_ground_truth_replay() -> None:
    """`replay_ground_truth` is the one execution of a task's ground truth: the seed's expert transitions are the
    expert episode's committed calls with their real results, and `before` sees each call on the state it meets."""
    task = envs.load_task("bfcl:multi_turn_miss_func_0")  # its missed-function turn has no ground-truth call
    assert any(not calls for calls in task.ground_truth)
    ep = expert_episode(task)
    committed = [s for s in ep.steps if s.kind == "call"]
    seeded = task_transitions(task, {}, random.Random(0), explore=0)
    assert [(x.tool, list(x.arguments.items()), x.response, x.error) for x in seeded] == [
        (s.chosen_branch.call.name, list(s.chosen_branch.call.arguments.items()), s.chosen_branch.actual,
         s.chosen_branch.actual_error) for s in committed]
    env = envs.make_env(task)
    met: list[tuple[object, bool]] = []
    golds = [gold for turn in range(len(task.ground_truth)) for gold in replay_ground_truth(
        task, env, turn, states=True, before=lambda gold: met.append((gold.result, env.state() == gold.state_before)))]
    assert met == [(None, True)] * len(committed)
    assert [(g.state_before, g.state_after) for g in golds] == [(s.state_before, s.state_after) for s in committed]

# ---- atomic saves ---------------------------------------------------------------------------------------


class FakeModel:
    def save_pretrained(self, path: str, **kwargs) -> None:
        Path(path, "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/x/y"}))
        Path(path, "adapter_model.safetensors").write_bytes(b"weights")


def _boom(tmp: Path) -> None:
    raise KeyboardInterrupt("killed mid-save")


def test_save_is_atomic_and_a_killed_save_leaves_nothing(tmp_path: Path) -> None:
    out = save_adapter(FakeModel(), tmp_path / "a")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(TrainingError, match="already exists"):
        save_adapter(FakeModel(), tmp_path / "a")
    with pytest.raises(KeyboardInterrupt):
        save_adapter(FakeModel(), tmp_path / "b", _after_write=_boom)
    with pytest.raises(KeyboardInterrupt):
        save_adapter(FakeModel(), tmp_path / "a", replace=True, extra_files={"x": "new"}, _after_write=_boom)
    assert sorted(os.listdir(tmp_path)) == ["a"]  # no partial "b", no temp dirs
    assert not (tmp_path / "a" / "x").exists()    # the old adapter is intact
    save_adapter(FakeModel(), tmp_path / "a", replace=True, extra_files={"x": "new"})
    assert (tmp_path / "a" / "x").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["a"]


# ---- fine-tune input validation ----------------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    ({"steps": 0}, "--steps must be between 1 and 10000"),
    ({"steps": 10_001}, "--steps must be between 1 and 10000"),
    ({"lr": 0.0}, "--lr must be > 0"),
    ({"lr": -1e-3}, "--lr must be > 0"),
    ({"rank": 0}, "--rank must be between"),
    ({"parent": Path("/nonexistent/adapter")}, "is not a LoRA adapter directory"),
])
def test_bad_requests(tmp_path: Path, changes: dict, message: str) -> None:
    req = FinetuneRequest(out=tmp_path / "new", **changes)
    with pytest.raises(FinetuneError, match=message):
        validate_request(req)


def test_existing_out_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FinetuneError, match="already exists"):
        validate_request(FinetuneRequest(out=tmp_path))


def test_train_config_validation() -> None:
    for bad in ({"steps": 0}, {"lr": 0.0}, {"act_weight": 0.0, "rehearse_weight": 0.0}):
        with pytest.raises(TrainingError):
            TrainConfig(**bad).validate()


def test_no_corrections_is_a_clear_error(tmp_path: Path) -> None:
    store, _, ep = stored_mock_episode(tmp_path)
    with pytest.raises(FinetuneError, match="no corrected branches"):
        select_corrections(store)
    store.add_annotation(Annotation(branch_id=branch_ids(store, ep.id)[0], label="match"))
    with pytest.raises(FinetuneError, match="pass --annotated"):
        select_corrections(store)
    assert len(select_corrections(store, annotated=True)) == 1
    with pytest.raises(FinetuneError, match="in episodes nope"):
        select_corrections(store, episodes=["nope"], annotated=True)


@pytest.mark.parametrize("annotation, message", [
    # A string is the JSON string it is (what a person types is parsed before it is saved: tests/test_corrections.py).
    ({"corrected_action": "It is blue.", "corrected_action_kind": "call"}, "marked as a tool call but is plain text"),
    ({"corrected_action": '<tool_call>{"name": </tool_call>'}, "corrected action is not a valid tool call"),
])
def test_invalid_corrections(tmp_path: Path, annotation: dict, message: str) -> None:
    store, _, ep = stored_mock_episode(tmp_path)
    store.add_annotation(Annotation(branch_id=branch_ids(store, ep.id)[0], label="major", **annotation))
    with pytest.raises(FinetuneError, match=message):
        select_corrections(store)


def test_correction_rows_use_corrected_targets(tmp_path: Path) -> None:
    store, policy, ep = stored_mock_episode(tmp_path)
    ids = branch_ids(store, ep.id)
    store.add_annotation(Annotation(branch_id=ids[0], corrected_predicted={"ok": False}))
    store.add_annotation(Annotation(branch_id=ids[1], corrected_action=call("get", key="size")))
    from app.training.finetune import build_rows

    rows = build_rows(store, select_corrections(store), ctx_for(policy))
    assert [(r.role, r.target) for r in rows] == [
        ("rehearse", '{"ok": false}</execution_result>'),
        ("act", call("get", key="size"))]
    assert rows[0].prompt == policy.rehearse_calls[0][0]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be between 1 and 10000"),
    (["--steps", "5", "--lr", "0"], "--lr must be > 0"),
    (["--steps", "5", "--parent", "/nonexistent"], "is not a LoRA adapter directory"),
])
def test_cli_errors_are_one_line(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    code = main(["finetune", "--db", str(tmp_path / "x.db"), "--out", str(tmp_path / "new"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("share", ["1.5", "-0.1"])
def test_train_agent_refuses_a_state_share_outside_0_to_1(tmp_path: Path, capsys, share: str) -> None:
    code = main(["train-agent", "--out", str(tmp_path / "a"), "--state-share", share])
    err = capsys.readouterr().err
    assert code == 2 and "--state-share 0-1" in err and err.count("\n") == 1 and not (tmp_path / "a").exists()

@pytest.mark.parametrize("argv", [["--explore", "5"], ["--explore", "-1"], ["--explore", "1", "--explore-rows", "-3"]])
def test_train_agent_refuses_an_explore_outside_its_range(tmp_path: Path, capsys, argv: list[str]) -> None:
    code = main(["train-agent", "--out", str(tmp_path / "a"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and "--explore must be 0-4" in err and err.count("\n") == 1 and not (tmp_path / "a").exists()


def test_act_tasks_keep_every_act_row_of_the_drawn_training_tasks_in_episode_order() -> None:
    from app.training.agent import act_rows_of_tasks
    from app.training.rows import expert_rows

    ids = envs.list_tasks("multi_turn_base", "train")[:4]
    rows, _ = expert_rows(ids, PromptContext(lambda t: max(1, len(t) // 4), 8192))
    act = [r for r in rows if r.role == "act"]
    kept = act_rows_of_tasks(act, 2, random.Random(0))
    episodes = {r.ref.split("/", 1)[0] for r in kept}
    assert len(episodes) == 2
    # Every Act row of those two episodes, none of the others, in the order the replay wrote them (so a task's
    # prompts extend each other and pack), and turn ends' answers among them.
    assert kept == [r for r in act if r.ref.split("/", 1)[0] in episodes]
    assert {r.target.startswith("<tool_call>") for r in kept} == {True, False}  # calls and answers
    assert act_rows_of_tasks(act, 2, random.Random(0)) == kept  # a seeded draw
    assert len({r.ref.split("/", 1)[0] for r in act_rows_of_tasks(act, 99, random.Random(0))}) == 4


def test_train_agent_refuses_act_tasks_under_one(tmp_path: Path, capsys) -> None:
    code = main(["train-agent", "--out", str(tmp_path / "a"), "--act-tasks", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--act-tasks must be at least 1" in err and err.count("\n") == 1
    assert not (tmp_path / "a").exists()


def test_cli_missing_db(tmp_path: Path, capsys) -> None:
    code = main(["finetune", "--db", str(tmp_path / "x.db"), "--steps", "3", "--out", str(tmp_path / "n"),
                 "--parent", "none"])
    assert code == 2 and "does not exist" in capsys.readouterr().err


# ---- the real model ----------------------------------------------------------------------------------


def _table_counts(store: Store) -> tuple[int, int]:
    return store.db["adapters"].count, store.db["finetune_runs"].count


@pytest.mark.slow
def test_finetune_on_three_corrections_lowers_loss_and_nll(tmp_path: Path) -> None:
    store, _, ep = stored_mock_episode(tmp_path)
    ids = branch_ids(store, ep.id)
    assert len(ids) >= 3
    corrections = [{"value": "navy blue"}, {"keys": ["color"]}, {"error": "no such key: size"}]
    for branch_id, fixed in zip(ids[:3], corrections):
        store.add_annotation(Annotation(branch_id=branch_id, label="major", corrected_predicted=fixed))
    result = run_finetune(store, FinetuneRequest(out=tmp_path / "ft1", steps=8, lr=2e-3, rank=8, parent=None,
                                                 measure_agreement=False))
    losses = result.losses
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses
    before, after = result.metrics["before"], result.metrics["after"]
    assert after["rehearse_nll"] < before["rehearse_nll"], (before, after)
    assert result.data["rows"] == {"act": 0, "rehearse": 3, "replay_act": 0, "replay_rehearse": 0}  # no replay asked
    row = store.db["adapters"].get(result.adapter_id)
    assert row["parent"] is None and json.loads(row["data"])["annotations"] == [a["id"] for a in store.annotations()]
    assert (tmp_path / "ft1" / "adapter_model.safetensors").is_file()

    # Not measured on unseen calls: not the default, and the record says why.
    assert row["is_default"] == 0 and "not measured on unseen calls" in row["default_reason"]
    store.db["adapters"].update(result.adapter_id, {"is_default": 1})  # as if it had been made the default

    # A second fine-tune from that adapter, killed mid-save: nothing changes, the parent stays the default.
    counts = _table_counts(store)
    parent_files = {p.name: p.read_bytes() for p in (tmp_path / "ft1").iterdir()}
    with pytest.raises(KeyboardInterrupt):
        run_finetune(store, FinetuneRequest(out=tmp_path / "ft2", steps=2, lr=1e-3, parent=tmp_path / "ft1",
                                            measure_agreement=False), _save_hook=_boom)
    assert not (tmp_path / "ft2").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".ft2")]
    assert _table_counts(store) == counts
    assert {p.name: p.read_bytes() for p in (tmp_path / "ft1").iterdir()} == parent_files
    assert store.default_adapter() == str((tmp_path / "ft1").resolve())

    # It finishes when not killed, and the registry records the parent.
    second = run_finetune(store, FinetuneRequest(out=tmp_path / "ft2", steps=2, lr=1e-3, parent=tmp_path / "ft1",
                                                 measure_agreement=False))
    assert second.parent == result.adapter_id
    run = next(store.db["finetune_runs"].rows_where("adapter_id = ?", [second.adapter_id]))
    assert run["parent"] == result.adapter_id and run["status"] == "finished"
    assert store.default_adapter() == str((tmp_path / "ft1").resolve())  # a child not measured never replaces it


@pytest.mark.slow
def test_training_render_equals_policy_render() -> None:
    import model_backend
    from model_backend.training import render

    policy = model_backend.load_policy("embedded")
    task, scripted, _ = mock_episode()
    for prompt, _ in scripted.act_calls[:2]:
        assert render(policy.tokenizer, prompt) == policy.render(prompt)
    prompt = scripted.rehearse_calls[0][0]
    assert render(policy.tokenizer, prompt) == policy.render(prompt)


def test_heldout_comparison_runs_each_column_with_its_decoding(tmp_path: Path, monkeypatch) -> None:
    """The wiring of `train-agent --evaluate --previous`: which policy and setting each column gets
    (heldout_report and model loading replaced by recorders; the real episodes are the slow path)."""
    import json as _json

    import model_backend
    import model_backend.policy
    from app.training import agent as at

    calls = []
    monkeypatch.setattr(at, "heldout_report", lambda policy, n, settings, **kw: calls.append(
        (policy, settings.constrain, settings.relevance)) or {"tasks": [], "call_accuracy": 0.0})
    monkeypatch.setattr(model_backend, "load_model", lambda spec, adapter=None, **kw: f"weights+{adapter}")
    monkeypatch.setattr(model_backend.policy, "TransformersPolicy", lambda loaded: f"policy({loaded})")
    previous = tmp_path / "prev"
    previous.mkdir()
    cfg = at.AgentTrainingConfig(eval_tasks=2, eval_turns=1, eval_forced_calls=4, eval_minutes=0)
    out = at.heldout_comparison("new", cfg, report=lambda _: None, previous=previous)
    assert list(out) == ["adapter", "adapter_unconstrained", "adapter_unranked", "base", "previous",
                         "previous_unconstrained"]
    w = DEFAULT_RELEVANCE
    assert calls == [("new", True, w), ("new", False, w), ("new", True, 0.0), ("policy(weights+None)", True, w),
                     (f"policy(weights+{previous})", True, w), (f"policy(weights+{previous})", False, w)]
    # A previous adapter whose own card measured this protocol (before constraints existed) is reused.
    old_row = {"tasks": ["t"], "call_accuracy": 0.1}
    (previous / "training.json").write_text(_json.dumps({"heldout": {"adapter": old_row}, "config": {
        "eval_tasks": 2, "eval_turns": 1, "eval_forced_calls": 4, "eval_minutes": 0}}))
    calls.clear()
    out = at.heldout_comparison("new", cfg, report=lambda _: None, previous=previous)
    assert out["previous_unconstrained"] == old_row and len(calls) == 5
    calls.clear()
    out = at.heldout_comparison("new", cfg, report=lambda _: None, previous=previous, columns={"adapter_unranked"})
    assert list(out) == ["adapter_unranked"] and calls == [("new", True, 0.0)]


def test_evaluate_adapter_measures_only_the_named_columns_and_keeps_the_others(tmp_path: Path, monkeypatch) -> None:
    """`train-agent --evaluate A --eval-columns adapter`: the card's other columns stay as measured, the
    card is rewritten, and a card from another protocol or an unknown column is refused."""
    import json as _json

    import model_backend
    import model_backend.policy
    from app.training import agent as at

    monkeypatch.setattr(at, "heldout_report", lambda policy, n, settings, **kw: {
        "tasks": ["bfcl:multi_turn_base_3"], "max_turns": 2, "call_accuracy": 0.5, "relevance": settings.relevance})
    monkeypatch.setattr(model_backend, "load_model", lambda spec, adapter=None, **kw: "weights")
    monkeypatch.setattr(model_backend.policy, "TransformersPolicy", lambda loaded: "policy")
    monkeypatch.setattr(at, "write_card", lambda out, card: (out / "training.json").write_text(_json.dumps(card)))
    cfg = at.AgentTrainingConfig(eval_tasks=2, eval_turns=2, eval_forced_calls=4, eval_minutes=0)
    kept = {"tasks": ["bfcl:multi_turn_base_3"], "max_turns": 2, "call_accuracy": 0.25}
    card = {"config": {"eval_tasks": 2, "eval_turns": 2, "eval_forced_calls": 4, "eval_minutes": 0},
            "heldout": {"adapter_unranked": kept, "base": kept}, "train_seconds": 60.0, "eval_seconds": 30.0}
    (tmp_path / "training.json").write_text(_json.dumps(card))
    out = at.evaluate_adapter(tmp_path, cfg, columns={"adapter"})
    assert out["heldout"]["adapter_unranked"] == kept == out["heldout"]["base"]
    assert out["heldout"]["adapter"]["relevance"] == DEFAULT_RELEVANCE and out["eval_seconds"] >= 30.0
    assert _json.loads((tmp_path / "training.json").read_text())["heldout"]["adapter"]["call_accuracy"] == 0.5
    with pytest.raises(ValueError, match="unknown held-out column"):
        at.evaluate_adapter(tmp_path, cfg, columns={"adapter", "nonsense"})
    other = at.AgentTrainingConfig(eval_tasks=8, eval_turns=2, eval_forced_calls=4, eval_minutes=0)
    with pytest.raises(ValueError, match="another protocol .*eval_tasks=2"):
        at.evaluate_adapter(tmp_path, other, columns={"adapter"})


def test_single_turn_rows_teach_tool_selection_from_bfcl_answers() -> None:
    import jsonschema

    from app.envs.bfcl_tasks import single_turn_examples
    from app.formats import parse_action
    from app.training.rows import single_turn_rows

    count = lambda text: len(text.split())  # noqa: E731 (any token counter will do for prompt rendering)
    examples = {f"bfcl:{ex.id}": ex for c in ("multiple", "live_multiple") for ex in single_turn_examples(c)}
    rows = single_turn_rows(PromptContext(count, 8192))
    assert len(rows) == len(examples) > 1000
    first = rows[0]  # multiple_0: three sides given; the optional flags (first answer "") are left out
    assert parse_action(first.target).call.arguments == {"side1": 5, "side2": 4, "side3": 3}
    invalid = 0
    for row in rows:
        ex = examples[row.ref]
        call = parse_action(row.prompt.prefill + row.target).call
        assert row.role == "act" and row.source == "single_turn" and call.name == ex.name
        assert ex.request == row.prompt.messages[-1]["content"] and f"{ex.name}(" in row.prompt.messages[0]["content"]
        tool = next(t for t in ex.tools if t.name == call.name)
        try:
            jsonschema.validate(call.arguments, tool.parameters)
        except jsonschema.ValidationError:
            invalid += 1  # BFCL's own answers: e.g. an integer where the doc says float
    assert invalid <= len(rows) // 50
    # Under tool_choice=first the single user message is a turn's first step: the prompt prefills the call tag.
    ctx = PromptContext(count, 8192, RunSettings(tool_choice="first"))
    assert all(r.prompt.prefill == "<tool_call>" and not r.target.startswith("<tool_call>")
               for r in single_turn_rows(ctx, ["multiple"]))


@pytest.mark.slow
def test_the_fine_tunes_measurements_decode_as_the_app_and_leave_the_training_model_alone(shipped_policy) -> None:
    """`measuring_policy` (before/after greedy outputs) folds the LoRA into a copy: it writes what the app's own
    policy for that adapter writes, and the training model keeps its unmerged LoRA and its weights."""
    import torch

    from app.config import shipped_adapter
    from app.training.finetune import measuring_policy
    from model_backend import load_model
    from model_backend.base import GenerationConfig, Prompt

    loaded = load_model("embedded", adapter=shipped_adapter())
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if "lora_" in n}
    assert before  # the training model is a PEFT model with its LoRA unmerged
    measured = measuring_policy(loaded, loaded.model)
    prompts = [Prompt([{"role": "user", "content": f"Simulate cd(folder='d{i}') in a file system. Reply with JSON."}],
                      prefill="<execution_result>") for i in range(3)]
    config = GenerationConfig(max_new_tokens=24, temperature=0.0, stop=("</execution_result>",))
    assert [g.text for g in measured.rehearse(prompts, config)] == [g.text for g in shipped_policy.rehearse(prompts, config)]
    after = {n: p for n, p in loaded.model.named_parameters() if "lora_" in n}
    assert after.keys() == before.keys() and all(torch.equal(before[n], after[n]) for n in before)
    # its NLL of a target, scored on the prompt KV the decode left in its cache, is the training model's
    from app.training.finetune import rehearse_measure
    from model_backend.training import TrainRow, encode_rows, end_of_turn_text, nll_of_rows

    targets = ['{"current_working_directory": "d0"}', '{"error": "cd: d1: No such directory"}', 'null']
    rows = [TrainRow("rehearse", p, t + "</execution_result>") for p, t in zip(prompts, targets)]
    encoded, _ = encode_rows(loaded.tokenizer, rows)
    scores = rehearse_measure(measured, rows, encoded, end_of_turn_text(loaded.tokenizer))
    reference = nll_of_rows(loaded.model, encoded)
    assert [x for _, x in scores] == pytest.approx(reference, rel=0.02, abs=0.005)
    assert len({round(x, 3) for x in reference}) > 1  # the rows differ: a mix-up of rows would show
    assert measured.prefix_cache is not None and len(measured.prefix_cache) > 0


def test_forced_rehearsal_groups_tau2_calls_by_domain_and_bfcl_calls_by_category() -> None:
    from app.training.agent import _category

    airline = envs.list_tasks("airline", "heldout", suite="tau2")[0]
    assert _category(airline) == "tau2:airline"
    assert _category("bfcl:multi_turn_miss_param_7") == "multi_turn_miss_param"
