"""The Fine-tune tab through its callbacks: previews, validation, the job, and one real fine-tune.

Fast tests replace `run_finetune` with a test double (no model, milliseconds): they are
about the tab's wiring, not about training, which tests/test_training.py covers. The one
`slow` test drives the real fine-tune through the same callback the Run button calls.
"""
from __future__ import annotations

import html
import json
import threading
import uuid
from pathlib import Path

import pytest
from gradio_client import Client
from scripted import call, mock_episode

from app.service import finetune as finetune_service
from app.training.finetune import FinetuneError, FinetuneResult
from app.service import Services
from app.records import Annotation
from app.ui import build_demo, close_demo
from app.ui import constants as C
from app.ui import render
from app.ui.finetune_callbacks import FinetuneCallbacks
from app.ui.run_callbacks import RunCallbacks
from model_backend.training import Progress
from scripted import ScriptedPolicy


def no_model(model: str, adapter: str | None):
    return ScriptedPolicy([])


class FakeFinetune:
    """Test double of `app.training.finetune.run_finetune`: reports a few losses and registers an adapter row,
    without loading a model. `gate` holds it before training; `error` makes it fail instead."""

    def __init__(self, losses=(2.0, 1.4, 0.9), gate: threading.Event | None = None,
                 error: BaseException | None = None, default: tuple[bool, str] | None = None) -> None:
        self.losses, self.gate, self.error = list(losses), gate, error
        self.default = default or (False, "not made the default: it was not measured on unseen calls")
        self.requests: list = []

    def __call__(self, store, req, progress=None) -> FinetuneResult:
        self.requests.append(req)
        if self.gate is not None:
            assert self.gate.wait(10), "test double never released"
        if self.error is not None:
            raise self.error
        for i, loss in enumerate(self.losses, 1):
            progress(Progress(step=i, steps=len(self.losses), loss=loss, elapsed_s=0.1 * i, tokens=100 * i))
        req.out.mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):  # an adapter directory to continue
            (req.out / name).write_text("{}")
        adapter_id = uuid.uuid4().hex[:12]
        made, reason = self.default
        if made:
            store.db.execute("update adapters set is_default = 0")
        store.db["adapters"].insert({"id": adapter_id, "path": str(req.out.resolve()), "parent": None,
                                     "base_model": req.spec, "data": "{}", "metrics": "{}", "created_at": "now",
                                     "is_default": int(made), "default_reason": reason})
        metrics = {"before": {"rehearse_nll": 1.5, "rehearse_exact": 0.0, "act_nll": 0.8, "act_agreement": 0.0},
                   "after": {"rehearse_nll": 0.5, "rehearse_exact": 1.0, "act_nll": 0.6, "act_agreement": 1.0},
                   "heldout": {"rows": ["a", "b"], "before": {"rehearse_nll": 0.3, "act_nll": 0.4},
                               "after": {"rehearse_nll": 0.35, "act_nll": 0.4}},
                   "train": {"steps": 3, "loss_first": 2.0, "loss_last": 0.9, "tokens_per_s": 500.0},
                   "seconds": 0.3, "default": {"made_default": made, "reason": reason}}
        return FinetuneResult(adapter_id, req.out, 1, None, {}, self.losses, metrics)


@pytest.fixture
def tab(tmp_path: Path):
    """The tab's callbacks on a database holding one mock episode, writing adapters under tmp_path."""
    services = Services(str(tmp_path / "ui.db"), no_model)
    _, _, episode = mock_episode(store=services.store)
    cb = FinetuneCallbacks(services, RunCallbacks(services).adapter_choices, adapter_root=tmp_path / "adapters")
    yield cb, episode
    assert not finetune_service.is_running(), "a test left a fine-tune running"


def call_branches(cb: FinetuneCallbacks, episode_id: str) -> list[int]:
    return [r["id"] for r in cb.services.store.branch_rows(episode_id) if r["kind"] == "call"]


def correct_two(cb: FinetuneCallbacks, episode_id: str) -> list[int]:
    """A corrected response on one branch, a corrected action on another."""
    ids = call_branches(cb, episode_id)
    store = cb.services.store
    store.add_annotation(Annotation(branch_id=ids[0], label="major", corrected_predicted={"value": "navy"}))
    store.add_annotation(Annotation(branch_id=ids[1], label="minor", corrected_action=call("get", key="size")))
    return ids[:2]


def form(**overrides):
    values = dict(episodes=[], annotated=False, steps=3, lr=1e-3, rank=8, parent=C.PARENT_NONE, name="ft-test",
                  heldout_rows=2, agreement=True)
    values.update(overrides)
    return values


def counts(cb: FinetuneCallbacks) -> tuple[int, int]:
    db = cb.services.store.db
    return db["adapters"].count, db["finetune_runs"].count


def choice_values(dropdown) -> list[str]:
    return [value for _, value in dropdown.choices]


# ---- layout and wiring ----------------------------------------------------------------------------


def test_the_tab_is_wired_to_the_run_tabs_adapter_dropdown(tmp_path: Path) -> None:
    demo = build_demo(db_path=str(tmp_path / "x.db"), policy_loader=no_model)
    fns = {fn.api_name: fn for fn in demo.fns.values() if fn.api_name}
    run_adapter = next(b for b in demo.blocks.values() if getattr(b, "label", None) == "Adapter (LoRA)")
    assert run_adapter in fns["finetune"].outputs
    assert fns["finetune"].concurrency_id == "finetune" and "finetune_preview" in fns
    assert any(getattr(b, "label", None) == "Fine-tune" for b in demo.blocks.values())


def test_preview_and_finetune_through_the_server(tmp_path: Path, monkeypatch) -> None:
    """The endpoints as a page calls them: the generator, the plots and the Run tab's dropdown serialize."""
    monkeypatch.setattr(finetune_service, "ADAPTER_ROOT", tmp_path / "adapters")
    monkeypatch.setattr(finetune_service, "run_finetune", FakeFinetune())
    demo = build_demo(db_path=str(tmp_path / "x.db"), policy_loader=no_model)
    _, _, episode = mock_episode(store=demo.services.store)
    correct_two(FinetuneCallbacks(demo.services, lambda: None), episode.id)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        client = Client(url, verbose=False)
        _, summary, table = client.predict([], False, api_name="/finetune_preview")
        assert "**2 branches**" in summary and len(table["data"]) == 2
        message, _, loss, rows, _, _, _, run_adapter = client.predict(
            *form(name="via-api").values(), api_name="/finetune")
    finally:
        close_demo(demo)
    new = str((tmp_path / "adapters" / "via-api").resolve())
    assert "registered" in message and json.loads(loss["plot"])["data"][0]["y"] == [2.0, 1.4, 0.9]
    assert rows["data"][0][:2] == ["trained on (the corrections)", "Rehearse NLL"] and [new, new] in run_adapter["choices"]


# ---- the data preview ------------------------------------------------------------------------------


def test_preview_lists_the_corrected_branches_and_their_rows(tab) -> None:
    cb, episode = tab
    ids = correct_two(cb, episode.id)
    message, summary, rows = cb.preview([], False)
    assert message == ""
    assert [(r[1], r[6], r[7], r[8]) for r in rows] == [(ids[0], "response", 0, 1), (ids[1], "action", 1, 0)]
    assert "**2 branches** → 1 Act row(s) and 1 Rehearse row(s)" in summary and episode.id in summary
    assert cb.refresh()[0].choices == [(f"mock:kv · {episode.id} (2 annotations)", episode.id)]


def test_preview_without_corrections_says_what_to_do(tab) -> None:
    cb, episode = tab
    message, summary, rows = cb.preview([], False)
    assert "no corrected branches" in message and "annotate some branches first" in message and rows == []
    cb.services.store.add_annotation(Annotation(branch_id=call_branches(cb, episode.id)[0], label="match"))
    _, summary, rows = cb.preview([], True)  # annotated without a correction: its real response
    assert [(r[6], r[8]) for r in rows] == [("real response", 1)]


# ---- bad input: a message, a warning, nothing changed ----------------------------------------------


@pytest.mark.parametrize("overrides, text", [
    ({"steps": 0}, f"Steps must be a whole number from 1 to {C.FT_MAX_STEPS}; got 0."),
    ({"steps": 100000}, f"Steps must be a whole number from 1 to {C.FT_MAX_STEPS}; got 100000."),
    ({"steps": 2.5}, "Steps must be a whole number"),
    ({"steps": None}, "Steps is empty"),
    ({"lr": 0}, "Learning rate must be above 0"),
    ({"lr": 5}, "Learning rate must be a number from 0 to 1; got 5."),
    ({"lr": "abc"}, "Learning rate must be a number"),
    ({"rank": 0}, "Rank must be a whole number from 1 to 256"),
    ({"heldout_rows": -1}, "Held-out rows must be a whole number from 0"),
    ({"name": "../escape"}, "is not usable"),
    ({"name": ""}, "is not usable"),
    ({"parent": "/nonexistent/adapter"}, "is not a LoRA adapter directory"),
    ({"episodes": ["nope"]}, "no corrected branches in episodes nope"),
])
def test_bad_input_is_refused_before_anything_runs(tab, monkeypatch, overrides: dict, text: str) -> None:
    cb, episode = tab
    correct_two(cb, episode.id)
    fake = FakeFinetune()
    monkeypatch.setattr(finetune_service, "run_finetune", fake)
    before = counts(cb)
    with pytest.warns(UserWarning) as warned:  # gr.Warning outside a request: a Python warning
        views = list(cb.run(**form(**overrides)))
    assert text.split(";")[0] in str(warned[0].message)
    assert len(views) == 1
    message = views[0][0]
    assert "ea-msg-error" in message and text in message.replace("&#x27;", "'") and "Nothing was changed" in message
    assert fake.requests == [] and counts(cb) == before and not cb.adapter_root.exists()


def test_nothing_selected_and_invalid_stored_json(tab, monkeypatch) -> None:
    cb, episode = tab
    monkeypatch.setattr(finetune_service, "run_finetune", FakeFinetune())
    message = list(cb.run(**form()))[0][0]
    assert "no corrected branches" in message and "Nothing was changed" in message
    # A correction stored by something other than the Annotate tab, not valid JSON.
    cb.services.store.db["annotations"].insert({"branch_id": call_branches(cb, episode.id)[0], "label": "major",
                                                "corrected_predicted": '{"value": ', "created_at": "now"})
    message = list(cb.run(**form()))[0][0]
    assert "the stored corrected response is not valid JSON" in message
    assert "not valid JSON" in cb.preview([], False)[0] and counts(cb) == (0, 0)


def test_an_episode_whose_prompts_cannot_be_rebuilt_is_left_out_with_a_note(tab) -> None:
    """A typed instruction whose text was never recorded (typed instructions that were trains: test_corrections)."""
    cb, episode = tab
    correct_two(cb, episode.id)
    cb.services.store.db["episodes"].update(episode.id, {"task_id": "instruction:GorillaFileSystem"})
    message, summary, rows = cb.preview([], False)
    assert message == "" and [(r[7], r[8]) for r in rows] == [(0, 0), (0, 0)]
    assert "**Left out** (1)" in summary and "text was never recorded" in summary and episode.id in summary


def test_an_existing_adapter_directory_is_refused(tab, monkeypatch) -> None:
    cb, episode = tab
    correct_two(cb, episode.id)
    (cb.adapter_root / "taken").mkdir(parents=True)
    monkeypatch.setattr(finetune_service, "run_finetune", FakeFinetune())
    assert "already exists: choose another adapter name" in list(cb.run(**form(name="taken")))[0][0]


# ---- the job ----------------------------------------------------------------------------------------


def test_run_streams_the_loss_then_shows_before_after_and_new_choices(tab, monkeypatch) -> None:
    cb, episode = tab
    correct_two(cb, episode.id)
    fake = FakeFinetune()
    monkeypatch.setattr(finetune_service, "run_finetune", fake)
    views = list(cb.run(**form(episodes=[episode.id])))
    req = fake.requests[0]
    assert (req.steps, req.lr, req.rank, req.parent, req.episodes, req.heldout_rows) == \
        (3, 1e-3, 8, None, [episode.id], 2)
    assert req.out == cb.adapter_root / "ft-test"
    # started, one view per training step, finished
    assert len(views) == 5 and "Fine-tuning" in views[0][0]
    assert [list(v[2].data[0].y) for v in views[1:4]] == [[2.0], [2.0, 1.4], [2.0, 1.4, 0.9]]
    assert "Measuring after and saving" in views[3][1]
    message, status, _, rows, figure, parent, name, run_adapter = views[-1]
    assert "registered" in message and "Run tab" in message and "loss 2.0 → 0.9" in status
    assert ["trained on (the corrections)", "Rehearse NLL", 1.5, 0.5, "-1.0000 (better)"] in rows
    assert ["held-out (2 rows)", "Rehearse NLL", 0.3, 0.35, "+0.0500 (worse)"] in rows
    assert {t.name for t in figure.data} == {"before", "after"}
    new = str(req.out.resolve())
    assert new in choice_values(run_adapter) and new in choice_values(parent)
    assert name != "ft-test" and name.startswith("ft-")


@pytest.mark.parametrize("error, text", [
    (FinetuneError("training diverged"), "The fine-tune failed: training diverged."),
    (RuntimeError("out of memory"), "The fine-tune failed: RuntimeError: out of memory."),
])
def test_a_failing_finetune_is_reported_and_frees_the_slot(tab, monkeypatch, error, text) -> None:
    cb, episode = tab
    correct_two(cb, episode.id)
    monkeypatch.setattr(finetune_service, "run_finetune", FakeFinetune(default=(True, "made the default")))
    parent = str((cb.adapter_root / "parent").resolve())
    list(cb.run(**form(name="parent")))
    assert cb.services.store.default_adapter() == parent == cb.default_parent()
    monkeypatch.setattr(finetune_service, "run_finetune", FakeFinetune(error=error))
    with pytest.warns(UserWarning, match="The fine-tune failed"):
        views = list(cb.run(**form(parent=parent)))
    assert text in views[-1][0] and "Nothing was changed" in views[-1][0] and "ea-msg-error" in views[-1][0]
    assert counts(cb) == (1, 0) and not finetune_service.is_running()
    # The parent is still the default: the Run tab and the next fine-tune start from it.
    assert cb.services.store.default_adapter() == parent == cb.default_parent() == cb.services.default_adapter()


def test_a_child_worse_on_the_others_is_not_made_the_default_and_the_tab_says_why(tab, monkeypatch) -> None:
    cb, episode = tab
    correct_two(cb, episode.id)
    monkeypatch.setattr(finetune_service, "run_finetune", FakeFinetune(default=(True, "made the default: other tools "
                                                                              "0.48 -> 0.48 on 120 unseen calls")))
    message, status, *_, parent, _, run_adapter = list(cb.run(**form(name="good")))[-1]
    message = html.unescape(message)
    good = str((cb.adapter_root / "good").resolve())
    assert "made the default: other tools 0.48 -> 0.48" in message and "ea-msg-info" in message
    assert run_adapter.value == good and parent.value == good  # the Run tab and the next fine-tune start from it
    why = "not made the default: worse on the other tools, Rehearse exact 0.48 -> 0.40 on 120 unseen calls"
    monkeypatch.setattr(finetune_service, "run_finetune", FakeFinetune(default=(False, why)))
    message, status, *_, parent, _, run_adapter = list(cb.run(**form(name="worse", parent=good)))[-1]
    message = html.unescape(message)
    assert why in message and "ea-msg-warning" in message and render.md_text(why) in status  # literal text
    assert getattr(run_adapter, "value", None) != str((cb.adapter_root / "worse").resolve())
    assert parent.value == good and cb.services.store.default_adapter() == good
    assert cb.services.store.db["adapters"].get(
        next(r["id"] for r in cb.services.store.db["adapters"].rows_where("path like ?", ["%worse"])))[
        "default_reason"] == why


def test_a_second_finetune_is_refused_while_one_runs(tab, monkeypatch) -> None:
    cb, episode = tab
    correct_two(cb, episode.id)
    gate = threading.Event()
    fake = FakeFinetune(gate=gate)
    monkeypatch.setattr(finetune_service, "run_finetune", fake)
    first = cb.run(**form(name="first"))
    try:
        assert "Fine-tuning" in next(first)[0] and finetune_service.is_running()
        second = list(cb.run(**form(name="second")))
        assert len(second) == 1 and "A fine-tune is already running" in second[0][0]
    finally:
        gate.set()
    assert "registered" in list(first)[-1][0]
    assert [r.out.name for r in fake.requests] == ["first"] and counts(cb) == (1, 0)


# ---- the real model ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_finetune_through_the_tab(tab) -> None:
    cb, episode = tab
    store = cb.services.store
    for branch_id, fixed in zip(call_branches(cb, episode.id)[:2], [{"value": "navy blue"}, {"keys": ["color"]}]):
        store.add_annotation(Annotation(branch_id=branch_id, label="major", corrected_predicted=fixed))
    views = list(cb.run(**form(steps=3, lr=2e-3, rank=8, name="real", heldout_rows=2)))
    message, status, loss, rows, _, parent, _, run_adapter = views[-1]
    assert "registered" in message, message
    assert len(loss.data[0].y) == 3
    (row,) = store.db["adapters"].rows
    out = str((cb.adapter_root / "real").resolve())
    assert row["path"] == out and row["parent"] is None
    assert json.loads(row["data"])["rows"] == {"act": 0, "rehearse": 2, "replay_act": 0, "replay_rehearse": 0}
    assert out in choice_values(run_adapter) and out in choice_values(parent)
    measured = {(r[0].split(" ")[0], r[1]) for r in rows}
    assert {("trained", "Rehearse NLL"), ("trained", "Rehearse exact"), ("held-out", "Rehearse NLL"),
            ("held-out", "Act agreement")} <= measured
    assert all(isinstance(r[2], float) and isinstance(r[3], float) for r in rows)
