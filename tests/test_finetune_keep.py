"""Fix the tool, keep the rest (issue 36, part 3): replay rows mixed with the corrections, checkpoints with early
stopping that keep the best, and a child worse on the other tools never made the default.

Fast tests build rows from the real BFCL training split with an approximate token count (no model); the `slow`
one trains the real embedded model for three steps with a checkpoint after each.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted import branch_ids, stored_mock_episode

from app import envs
from app.cli.main import main
from app.formats import canonical_call, rehearse_target
from app.records import Annotation, Call
from app.store import Store
from app.service import finetune as finetune_service
from app.training.finetune import (CORRECTED, OTHERS, REPLAY_SOURCE, EarlyStopping, FinetuneError, FinetuneRequest,
                                   _register, default_decision, run_finetune, select_corrections, trained_calls,
                                   training_sample, validate_request)
from app.training.rows import PromptContext, expert_episode
from model_backend.base import Prompt
from model_backend.training import TrainRow
from app.service import InputError

CTX = PromptContext(lambda text: len(text) // 4 + 1, 1 << 20)
TRAIN_TASKS = set(envs.list_tasks("multi_turn_base", "train"))


def correction(role: str, i: int) -> TrainRow:
    return TrainRow(role, Prompt(messages=[]), "x", "correction", f"ep/{i}/0#annotation{i}")


def task_of(ref: str) -> str:
    return ref.split("/", 1)[0].removeprefix("expert-")


def _call_of(ref: str) -> str:
    episode_id, step, branch = ref.split("/")
    e = expert_episode(envs.load_task(task_of(episode_id)))
    return canonical_call(e.steps[int(step)].branches[int(branch)].call)


# ---- replay mixing ---------------------------------------------------------------------------------------


def test_replay_rows_come_in_the_stated_ratio_from_the_training_split_and_are_seeded() -> None:
    corrections = [correction("rehearse", i) for i in range(4)] + [correction("act", i) for i in range(2)]
    cd = Call(name="cd", arguments={"folder": "document"})
    trained = (canonical_call(cd), rehearse_target({"current_working_directory": "document"}))
    replay, selection = training_sample(CTX, corrections, 1.5, {"cd"}, {trained}, 3, seed=7)
    assert sum(r.role == "rehearse" for r in replay) == 6 and sum(r.role == "act" for r in replay) == 3
    assert {r.source for r in replay} == {REPLAY_SOURCE}
    assert {task_of(r.ref) for r in replay} <= TRAIN_TASKS  # the shipped adapter's own data, never held-out
    again, _ = training_sample(CTX, corrections, 1.5, {"cd"}, {trained}, 3, seed=7)
    other, _ = training_sample(CTX, corrections, 1.5, {"cd"}, {trained}, 3, seed=8)
    assert [r.ref for r in again] == [r.ref for r in replay] and [r.ref for r in other] != [r.ref for r in replay]
    # Validation calls: the corrected tool's and the others', none a replay row or a trained call.
    assert len(selection[CORRECTED]) == 3 and {t for t, _ in selection[CORRECTED]} == {"cd"}
    assert len(selection[OTHERS]) == 3 and "cd" not in {t for t, _ in selection[OTHERS]}
    assert trained not in {(_call_of(r.ref), r.target) for _, r in selection[CORRECTED]}
    assert canonical_call(cd) not in {_call_of(r.ref) for r in replay if r.role == "rehearse"}
    picked = {r.ref for items in selection.values() for _, r in items}
    assert not picked & {r.ref for r in replay}
    assert {task_of(ref) for ref in picked} <= TRAIN_TASKS


def test_no_replay_row_rehearses_a_trained_call() -> None:
    ep = expert_episode(envs.load_task(sorted(TRAIN_TASKS)[0]))
    trained = {(canonical_call(b.call), rehearse_target(b.actual)) for s in ep.steps for b in s.branches
               if b.call is not None}
    corrections = [correction("rehearse", i) for i in range(10)]
    replay, _ = training_sample(CTX, corrections, 2.0, set(), trained, 0, seed=0)
    assert len(replay) == 20
    calls = {}
    for task_id in {task_of(r.ref) for r in replay}:
        e = expert_episode(envs.load_task(task_id))
        calls.update({f"{e.id}/{s.index}/{b.index}": b.call for s in e.steps for b in s.branches if b.call})
    assert not {canonical_call(calls[r.ref]) for r in replay} & {c for c, _ in trained}  # in no state at all


def test_ratio_zero_gives_no_replay() -> None:
    replay, selection = training_sample(CTX, [correction("rehearse", 0)], 0.0, set(), set(), 0)
    assert replay == [] and selection == {CORRECTED: [], OTHERS: []}


# ---- early stopping ----------------------------------------------------------------------------------------


def test_early_stopping_keeps_the_lowest_corrected_nll_and_stops_after_patience() -> None:
    stop = EarlyStopping(patience=2)
    assert stop.add(0, 1.0, 0.5) == (True, False)      # the parent
    assert stop.add(2, 0.7, 0.51) == (True, False)
    assert stop.add(4, 0.6, 0.52) == (True, False)
    assert stop.add(6, 0.65, 0.52) == (False, False)
    assert stop.add(8, 0.61, 0.53) == (False, True)    # two checkpoints without beating step 4
    assert stop.best.step == 4 and "had not improved on step 4's for 2" in stop.stopped
    assert [c["step"] for c in stop.summary()["checkpoints"]] == [0, 2, 4, 6, 8]


def test_a_checkpoint_worse_on_the_other_tools_stops_and_is_never_kept() -> None:
    stop = EarlyStopping(patience=3, worse=0.10)
    stop.add(0, 1.0, 0.50)
    stop.add(1, 0.8, 0.54)                               # +8%: not worse
    assert stop.add(2, 0.2, 0.56) == (False, True)       # +12%: worse, even though the corrected tools improved
    assert stop.best.step == 1 and stop.history[-1].others_worse and "rose from 0.500 to 0.560" in stop.stopped


def test_without_validation_calls_of_the_corrected_tools_the_latest_good_checkpoint_is_kept() -> None:
    stop = EarlyStopping(patience=1)
    for step, others in ((0, 0.5), (1, 0.5), (2, 0.52)):
        assert stop.add(step, None, others) == (True, False)
    assert stop.best.step == 2 and stop.stopped is None


# ---- the default adapter -----------------------------------------------------------------------------------


def unseen(before: float, after: float, n: int = 120) -> dict:
    return {"unseen": {"groups": {OTHERS: {"n": n, "before": {"rehearse_exact": before},
                                           "after": {"rehearse_exact": after}}}}}


@pytest.mark.parametrize("metrics, made, words", [
    (unseen(0.48, 0.47), True, "made the default: other tools 0.48 -> 0.47 on 120 unseen calls"),
    (unseen(0.48, 0.46), True, "made the default"),
    (unseen(0.48, 0.45), False, "not made the default: worse on the other tools, Rehearse exact 0.48 -> 0.45 on 120"),
    ({}, False, "not measured on unseen calls of the other tools"),
    (unseen(0.5, 0.5, n=0), False, "not measured"),
])
def test_default_decision(metrics: dict, made: bool, words: str) -> None:
    decision, reason = default_decision(metrics, 0.02)
    assert decision is made and words in reason


class _Result:
    losses = [1.0]


def _register_child(store: Store, tmp: Path, name: str, metrics: dict, parent: str | None = None) -> str:
    made, reason = default_decision(metrics)
    metrics = {**metrics, "default": {"made_default": made, "reason": reason}}
    out = tmp / name
    out.mkdir()
    _register(store, name, out, parent, {}, metrics, _Result(), "now", FinetuneRequest(out=out))
    return str(out.resolve())


def test_a_child_worse_on_the_others_is_not_made_the_default_and_the_reason_is_stored(tmp_path: Path) -> None:
    store = Store(tmp_path / "r.db")
    assert store.default_adapter() is None
    parent = _register_child(store, tmp_path, "parent", unseen(0.48, 0.48))
    assert store.default_adapter() == parent
    _register_child(store, tmp_path, "worse", unseen(0.48, 0.40), parent="parent")
    assert store.default_adapter() == parent  # the parent stays
    row = store.db["adapters"].get("worse")
    assert row["is_default"] == 0 and "worse on the other tools, Rehearse exact 0.48 -> 0.40" in row["default_reason"]
    assert json.loads(row["metrics"])["default"]["made_default"] is False
    better = _register_child(store, tmp_path, "fine", unseen(0.48, 0.49), parent="parent")
    assert store.default_adapter() == better
    assert [r["id"] for r in store.db["adapters"].rows_where("is_default = 1")] == ["fine"]


def test_an_older_database_gets_the_default_columns(tmp_path: Path) -> None:
    import sqlite_utils

    db = sqlite_utils.Database(tmp_path / "old.db")
    db["adapters"].insert({"id": "a", "path": "/x", "parent": None, "base_model": "embedded", "data": "{}",
                           "metrics": "{}", "created_at": "then"}, pk="id")
    db.close()
    store = Store(tmp_path / "old.db")
    assert {"is_default", "default_reason"} <= set(store.db["adapters"].columns_dict)
    assert store.default_adapter() is None


# ---- options: bad values are refused with one line -----------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    ({"replay_ratio": -0.5}, "--replay-ratio must be between 0 and 10"),
    ({"replay_ratio": 11.0}, "--replay-ratio must be between 0 and 10"),
    ({"eval_every": -1}, "--eval-every must be between 0 (no checkpoints) and 10000"),
    ({"eval_every": 10_001}, "--eval-every must be between 0"),
    ({"worse_by": 2.0}, "--worse-by must be between 0 and 1"),
])
def test_bad_options(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(FinetuneError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_request(FinetuneRequest(out=tmp_path / "new", **changes))


@pytest.mark.parametrize("argv, message", [
    (["--steps", "5", "--replay-ratio", "-1"], "--replay-ratio must be between 0 and 10"),
    (["--steps", "5", "--eval-every", "-2"], "--eval-every must be between 0 (no checkpoints) and 10000"),
])
def test_cli_option_errors_are_one_line(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    code = main(["finetune", "--db", str(tmp_path / "x.db"), "--out", str(tmp_path / "new"), "--parent", "none", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("field, value, text", [
    ("replay_ratio", -1, "Replay ratio must be a number from 0 to 10"),
    ("replay_ratio", "x", "Replay ratio must be a number"),
    ("eval_every", 501, "Evaluate every N steps must be a whole number from 0 to 500"),
    ("eval_every", 1.5, "Evaluate every N steps must be a whole number"),
])
def test_form_option_errors_name_the_field(tmp_path: Path, field: str, value, text: str) -> None:
    values = dict(episodes=None, annotated=False, steps=3, lr=1e-3, rank=8, parent=None, out=tmp_path / "o",
                  heldout_rows=0, agreement=False, max_steps=500, unseen_rows=0, replay_ratio=1, eval_every=1)
    values[field] = value
    with pytest.raises(InputError, match=text):
        finetune_service.build_request(**values)


# ---- the real model ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoints_keep_the_best_step_and_the_replay_is_trained_on(tmp_path: Path) -> None:
    from model_backend import load_model
    from model_backend.training import encode_rows, nll_of_rows

    store, _, ep = stored_mock_episode(tmp_path)
    for branch_id, fixed in zip(branch_ids(store, ep.id)[:2], [{"value": "navy blue"}, {"keys": ["color"]}]):
        store.add_annotation(Annotation(branch_id=branch_id, label="major", corrected_predicted=fixed))
    req = FinetuneRequest(out=tmp_path / "child", steps=3, lr=5e-3, rank=4, parent=None, measure_agreement=False,
                          replay_ratio=1.0, eval_every=1, selection_rows=2, patience=3, seed=1)
    result = run_finetune(store, req)
    rows = result.data["rows"]
    assert (rows["rehearse"], rows["replay_rehearse"], rows["act"], rows["replay_act"]) == (2, 2, 0, 0)
    assert {task_of(ref) for ref in result.data["replay"]} <= TRAIN_TASKS
    cp = result.metrics["checkpoints"]
    points = cp["checkpoints"]
    assert points[0]["step"] == 0 and [p["step"] for p in points] == list(range(len(points)))
    assert result.metrics["train"]["steps"] == points[-1]["step"]
    # The mock tools are not BFCL tools: no validation call of them, so the latest checkpoint that is not worse on
    # the other tools is kept; its weights are the saved adapter's.
    assert all(p["corrected_nll"] is None for p in points)
    good = [p for p in points if not p["others_worse"]]
    assert cp["best_step"] == good[-1]["step"]
    kept = next(p for p in points if p["step"] == cp["best_step"])
    loaded = load_model("embedded", adapter=tmp_path / "child")
    validation = cp["validation"][OTHERS]
    assert len(validation) == 2
    tools, trained = trained_calls(store, select_corrections(store))
    ctx = PromptContext(lambda t: len(loaded.tokenizer.encode(t, add_special_tokens=False)), 8192)
    _, selection = training_sample(ctx, [correction("rehearse", 0), correction("rehearse", 1)], 1.0, tools, trained,
                                   2, seed=1)
    assert [r.ref for _, r in selection[OTHERS]] == validation
    encoded, _ = encode_rows(loaded.tokenizer, [r for _, r in selection[OTHERS]])
    nll = sum(nll_of_rows(loaded.model, encoded)) / len(encoded)
    assert abs(nll - kept["others_nll"]) < 2e-3, (nll, kept)
    # Not measured on unseen calls: not made the default, and the adapter's record and card say why.
    row = store.db["adapters"].get(result.adapter_id)
    assert row["is_default"] == 0 and "not measured on unseen calls" in row["default_reason"]
    card = json.loads((tmp_path / "child" / "finetune.json").read_text())
    assert "not measured" in card["metrics"]["default"]["reason"] and store.default_adapter() is None


def test_the_cli_passes_the_options_and_prints_the_checkpoints_and_the_default(tmp_path: Path, capsys,
                                                                               monkeypatch) -> None:
    """The CLI's wiring (the library is faked: the real fine-tune is the slow test above)."""
    import app.training.finetune as finetune

    seen = []

    def fake(store, req, progress=None):
        seen.append(req)
        metrics = {"before": {}, "after": {}, "train": {"steps": 4},
                   "checkpoints": {"checkpoints": [{"step": 0, "corrected_nll": 0.9, "others_nll": 0.4},
                                                   {"step": 2, "corrected_nll": 0.5, "others_nll": 0.41},
                                                   {"step": 4, "corrected_nll": 0.6, "others_nll": 0.47}],
                                   "best_step": 2, "every": 2, "trained_steps": 4,
                                   "stopped_early": "at step 4 the other tools' validation NLL rose"},
                   "default": {"made_default": False, "reason": "not made the default: worse on the other tools"}}
        return finetune.FinetuneResult("abc", req.out, 1, None, {}, [1.0] * 4, metrics)

    monkeypatch.setattr(finetune, "run_finetune", fake)
    Store(tmp_path / "x.db")
    code = main(["finetune", "--db", str(tmp_path / "x.db"), "--out", str(tmp_path / "new"), "--parent", "none",
                 "--steps", "8", "--replay-ratio", "0.5", "--eval-every", "2", "--worse-by", "0.05", "--seed", "3"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    (req,) = seen
    assert (req.replay_ratio, req.eval_every, req.worse_by, req.seed, req.steps) == (0.5, 2, 0.05, 3, 8)
    assert "Checkpoints every 2 steps" in out[-2] and "kept step 2" in out[-2] and "stopped early" in out[-2]
    assert out[-1] == "adapter abc: not made the default: worse on the other tools"
