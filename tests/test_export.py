"""`python -m app export --format trl`: the fine-tune's own rows as TRL conversational JSONL.

The export is loaded with `datasets` where it is installed (as `trl sft` would load it); without
it, with json and the row schema. Either way the test runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from scripted import ScriptedPolicy

from app.cli.main import main
from app.engine import EpisodeRunner
from app.envs import load_task
from app.training.finetune import build_rows, select_corrections
from app.records import Annotation, RunSettings
from app.store import Recorder, Store
from app.training.rows import PromptContext, self_training_rows
from app.training.trl_export import ROW_SCHEMA

SET = '<tool_call>{"name": "set", "arguments": {"key": "color", "value": "blue"}}</tool_call>'
GET = '<tool_call>{"name": "get", "arguments": {"key": "color"}}</tool_call>'
DELETE = '<tool_call>{"name": "delete", "arguments": {"key": "size"}}</tool_call>'


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished mock episode (K=2, shadow runs) with a corrected branch."""
    path = tmp_path_factory.mktemp("export") / "x.db"
    store = Store(path)
    policy = ScriptedPolicy([[SET, GET], ["Stored."], [DELETE, GET], [GET], ["The colour is blue."]],
                            predict=lambda text: {"value": 7} if '"get"' in text else {"ok": True})
    settings = RunSettings(mode="parallel", branches=2, selector="logprob")
    recorder = Recorder(store)
    runner = EpisodeRunner(load_task("mock:kv"), policy, settings, on_step=recorder)
    recorder.start(runner.episode)
    ep = runner.run_all()
    recorder.flush(ep)
    assert ep.success
    branch = next(b for b in store.branch_rows(ep.id) if b["step_idx"] == 0 and b["idx"] == 1)
    store.add_annotation(Annotation(branch_id=branch["id"], label="major", corrected_predicted={"value": None},
                                    annotator="t"))
    return path


def load_rows(path: Path) -> list[dict]:
    try:
        import datasets
    except ImportError:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            jsonschema.validate(row, ROW_SCHEMA)
        return rows
    return [_drop_nulls(r) for r in datasets.load_dataset("json", data_files=str(path), split="train")]


def _drop_nulls(value):
    """Arrow gives every row the union of the keys, absent ones as None: compare what was written."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None or k in ("predicted", "actual",
                                                                                        "branch", "chosen")}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def export(db: Path, out: Path, *args: str) -> list[dict]:
    assert main(["export", "--format", "trl", "--db", str(db), "--out", str(out), *args]) == 0
    return load_rows(out)


def ctx() -> PromptContext:
    from model_backend.loading import load_tokenizer

    tok, window = load_tokenizer("embedded")
    return PromptContext(lambda text: len(tok.encode(text, add_special_tokens=False)), window)


def test_corrections_are_the_finetune_rows(db: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = export(db, tmp_path / "c.jsonl", "--tool-format", "text", "--annotated")
    assert "wrote 1 rows (0 act, 1 rehearse)" in capsys.readouterr().out
    store = Store(db)
    expected = build_rows(store, select_corrections(store, None, True), ctx())
    assert len(rows) == len(expected) == 1
    (row,), (train,) = rows, expected
    assert row["messages"][:-1] == train.prompt.messages
    assert row["messages"][-1] == {"role": "assistant", "content": train.prompt.prefill + train.target}
    assert row["role"] == "rehearse" and row["source"] == "correction"
    assert row["rehearsal"]["branch"] == 1 and row["rehearsal"]["chosen"] is False
    assert json.loads(row["rehearsal"]["actual"]) == {"error": "no such key: color"}  # `get` shadowed before `set`
    assert row["rehearsal"]["predicted"].startswith("<execution_result>")
    assert json.loads(row["messages"][-1]["content"].split(">", 1)[1].split("<")[0]) == {"value": None}


def test_episode_rows_structured(db: Path, tmp_path: Path) -> None:
    rows = export(db, tmp_path / "e.jsonl", "--rows", "episodes")
    store = Store(db)
    expected = self_training_rows([store.get_episode(r["id"]) for r in store.list_episodes()], ctx())
    assert [r["ref"] for r in rows] == [t.ref for t in expected]
    act = [r for r in rows if r["role"] == "act"]
    rehearse = [r for r in rows if r["role"] == "rehearse"]
    assert act and rehearse and all("tools" in r for r in act)
    first = act[0]
    assert {t["function"]["name"] for t in first["tools"]} >= {"get", "set", "delete", "list_keys"}
    reply = first["messages"][-1]
    assert reply["role"] == "assistant" and reply["tool_calls"][0]["function"]["name"] == "set"
    assert json.loads(reply["tool_calls"][0]["function"]["arguments"]) == {"key": "color", "value": "blue"}
    later = next(r for r in act if any(m["role"] == "tool" for m in r["messages"]))
    tool_msgs = [m for m in later["messages"] if m["role"] == "tool"]
    assert tool_msgs[0]["name"] == "set" and json.loads(tool_msgs[0]["content"]) == {"ok": True}
    chosen = [r for r in rows if r["rehearsal"]["chosen"]]
    assert chosen and all(isinstance(r["rehearsal"]["branch"], int) for r in rows)


def test_export_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["export", "--db", str(tmp_path / "none.db"), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "no database at" in capsys.readouterr().err
    empty = tmp_path / "empty.db"
    Store(empty)
    assert main(["export", "--db", str(empty), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "no corrected branches" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_prompt_completion_shape(db: Path, tmp_path: Path) -> None:
    messages = export(db, tmp_path / "m.jsonl", "--rows", "episodes")
    split = export(db, tmp_path / "p.jsonl", "--rows", "episodes", "--shape", "prompt-completion")
    assert len(split) == len(messages)
    for a, b in zip(messages, split):
        assert "messages" not in b and b["prompt"] + b["completion"] == a["messages"]
