"""Episodes as JSONL: export with annotations, import into another database, and bad files that change nothing."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from app import envs
from app.cli.main import main
from app.engine import EpisodeRunner
from app.records import Annotation, RunSettings
from app.store import Recorder, Store
from app.trace_io import FORMAT, TraceFileError, export_episodes, import_records, parse_traces, read_trace_file
from scripted import ScriptedPolicy


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def stored_episode(store: Store, seed: int = 0) -> str:
    """A mock episode by a scripted policy (a unit-test stand-in for the model), written as the UI writes it."""
    script = [[call("set", key="color", value="blue"), call("list_keys")], ["Stored."], [call("get", key="color")],
              ["Blue."]]
    policy = ScriptedPolicy([list(s) for s in script], predict=lambda text: {"ok": True})
    recorder = Recorder(store)
    runner = EpisodeRunner(envs.load_task("mock:kv"), policy,
                           RunSettings(mode="parallel", branches=2, selector="logprob", seed=seed), on_step=recorder)
    recorder.start(runner.episode)
    runner.run_all()
    recorder.flush(runner.episode)
    return runner.episode.id


def counts(path: Path) -> dict[str, int]:
    conn = sqlite3.connect(path)
    try:
        return {t: conn.execute(f"select count(*) from {t}").fetchone()[0]
                for t in ("episodes", "steps", "branches", "annotations")}
    finally:
        conn.close()


@pytest.fixture
def exported(tmp_path: Path) -> tuple[Path, Store, str]:
    store = Store(tmp_path / "src.db")
    episode_id = stored_episode(store)
    branch = store.branch_rows(episode_id)[1]  # step 0, branch 1 (the sampled alternative)
    store.add_annotation(Annotation(branch_id=branch["id"], label="major", corrected_predicted={"keys": ["color"]},
                                    note="the mock lists keys", annotator="tester"))
    out = tmp_path / "traces.jsonl"
    assert export_episodes(store, out) == 1
    return out, store, episode_id


def test_round_trip_keeps_every_branch_and_annotation(exported, tmp_path: Path) -> None:
    out, src, episode_id = exported
    dst = Store(tmp_path / "dst.db")
    result = import_records(dst, read_trace_file(out))
    assert result.imported == [episode_id] and result.annotations == 1
    assert dst.get_episode(episode_id).model_dump() == src.get_episode(episode_id).model_dump()
    (step, branch, ann), = dst.annotations_by_position(episode_id)
    assert (step, branch) == (0, 1)
    assert (ann.label, ann.corrected_predicted, ann.annotator) == ("major", {"keys": ["color"]}, "tester")
    assert dst.get_branch(ann.branch_id)[0]["episode_id"] == episode_id


def test_a_shadow_write_and_its_fork_state_round_trip(tmp_path: Path) -> None:
    src = Store(tmp_path / "src.db")
    policy = ScriptedPolicy([[call("set", key="color", value="blue"), call("delete", key="size")]])
    runner = EpisodeRunner(envs.load_task("mock:kv"), policy,
                           RunSettings(mode="parallel", branches=2, selector="logprob"), on_step=Recorder(src))
    runner.step()
    out = tmp_path / "traces.jsonl"
    export_episodes(src, out, [runner.episode.id])
    line = json.loads(out.read_text())
    assert line["episode"]["steps"][0]["branches"][1]["shadow_state_after"] == {"MockKV": {"store": {}}}
    dst = Store(tmp_path / "dst.db")
    import_records(dst, read_trace_file(out))
    shadow = dst.get_episode(runner.episode.id).steps[0].branches[1]
    assert shadow.actual_source == "shadow" and shadow.shadow_state_after == {"MockKV": {"store": {}}}
    assert dst.get_episode(runner.episode.id).model_dump() == src.get_episode(runner.episode.id).model_dump()


def test_an_episode_already_present_refuses_the_whole_file_unless_skipped(exported, tmp_path: Path) -> None:
    out, src, episode_id = exported
    dst = Store(tmp_path / "dst.db")
    other = stored_episode(dst, seed=1)
    lines = out.read_text().splitlines()
    # A file with a new episode first and the clashing one second: neither may land.
    new = json.loads(lines[0])
    new["episode"]["id"] = "brand-new"
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps(new) + "\n" + json.dumps({**json.loads(lines[0]), "episode": dst.get_episode(other).model_dump(mode="json")}) + "\n")
    before = counts(tmp_path / "dst.db")
    assert main(["import", str(both), "--db", str(tmp_path / "dst.db")]) == 2
    assert counts(tmp_path / "dst.db") == before
    assert main(["import", str(both), "--db", str(tmp_path / "dst.db"), "--skip-existing"]) == 0
    assert {r["id"] for r in dst.list_episodes()} == {other, "brand-new"}


@pytest.mark.parametrize("mutate,message", [
    (lambda rec: "{not json", "line 1: not JSON"),
    (lambda rec: json.dumps({**rec, "format": "trl"}), "not an EnvACE episode record"),
    (lambda rec: json.dumps({**rec, "episode": {**rec["episode"], "settings": {"mode": "fast"}}}),
     "line 1: episode.settings.mode"),
    (lambda rec: json.dumps({**rec, "episode": {**rec["episode"], "steps": [{**rec["episode"]["steps"][0], "chosen": 7}]}}),
     "chooses branch 7 of 2"),
    (lambda rec: json.dumps({**rec, "annotations": [{**rec["annotations"][0], "step": 40}]}),
     "points at step 40, branch 1, which the episode does not have"),
    (lambda rec: json.dumps({**rec, "annotations": [{**rec["annotations"][0], "label": "awful"}]}),
     "line 1: annotations.0.label"),
    (lambda rec: json.dumps({**rec, "episode": {**rec["episode"], "external_calls": 2**63}}),
     "line 1: episode.external_calls = 9223372036854775808 is outside the 64-bit integer range"),
    (lambda rec: json.dumps({**rec, "episode": {**rec["episode"], "steps": [
        {**rec["episode"]["steps"][0], "branches": [{**b, "duplicates": -2**63 - 1}
                                                     for b in rec["episode"]["steps"][0]["branches"]]}]}}),
     "line 1: episode.steps[0].branches[0].duplicates = -9223372036854775809 is outside"),
    (lambda rec: json.dumps(rec) + "\n" + json.dumps(rec), "line 2: episode"),
    (lambda rec: "\n\n", "holds no episodes"),
])
def test_bad_files_are_one_line_errors_and_change_nothing(exported, tmp_path: Path, capsys, mutate, message) -> None:
    out, _, _ = exported
    bad = tmp_path / "bad.jsonl"
    bad.write_text(mutate(json.loads(out.read_text())))
    db = tmp_path / "dst.db"
    stored_episode(Store(db))
    before = counts(db)
    assert main(["import", str(bad), "--db", str(db)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "nothing was imported" in err and len(err.splitlines()) == 1, err
    assert counts(db) == before


def test_oversized_files_and_lines_are_refused_before_reading(exported, tmp_path: Path, capsys) -> None:
    out, _, _ = exported
    with pytest.raises(TraceFileError, match=r"the file is 5.\d+ KiB; the limit is 100 bytes"):
        read_trace_file(out, max_bytes=100)
    with pytest.raises(TraceFileError, match="line 1: .* over the 8 MiB limit of one episode"):
        parse_traces(b" " * (8 * 2**20 + 1) + b"\n")
    assert main(["import", str(out), "--db", str(tmp_path / "x.db"), "--max-mb", "0.0001"]) == 2
    assert "traces.jsonl: the file is 5" in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists()  # refused before the database was created
    assert main(["import", str(tmp_path / "missing.jsonl"), "--db", str(tmp_path / "x.db")]) == 2
    assert "missing.jsonl: no such file; nothing was imported" in capsys.readouterr().err


def test_a_locked_database_imports_nothing(exported, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("app.store.BUSY_TIMEOUT_S", 0.2)  # the wait is not what is tested (5 s in the app)
    out, _, _ = exported
    db = tmp_path / "dst.db"
    Store(db)
    holder = sqlite3.connect(db)
    holder.execute("BEGIN IMMEDIATE")
    try:
        assert main(["import", str(out), "--db", str(db)]) == 2
        assert "is locked by another writer" in capsys.readouterr().err
    finally:
        holder.rollback()
        holder.close()
    assert counts(db)["episodes"] == 0
    assert main(["import", str(out), "--db", str(db)]) == 0  # once free, the same file lands
    assert counts(db)["annotations"] == 1


def test_cli_export_then_import(exported, tmp_path: Path, capsys) -> None:
    _, src, episode_id = exported
    out = tmp_path / "cli.jsonl"
    assert main(["export", "--format", "episodes", "--db", src.path, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote 1 episodes to {out}"
    assert json.loads(out.read_text())["format"] == FORMAT
    assert main(["import", str(out), "--db", str(tmp_path / "new.db")]) == 0
    assert capsys.readouterr().out.strip() == f"imported 1 episodes with 1 annotations into {tmp_path / 'new.db'}"
    assert main(["export", "--format", "episodes", "--db", src.path, "--out", str(out), "--episodes", "nope"]) == 2
    assert "no episode with id nope" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob(".*.tmp")) == []  # the failed export left no partial file
    assert json.loads(out.read_text())["format"] == FORMAT  # and the earlier export is still there
