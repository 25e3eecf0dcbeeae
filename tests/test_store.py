import sqlite3
import subprocess
import threading

import pytest

from app.records import Annotation, Branch, Call, Episode, Metrics, RunSettings, Step
from app.store import ADDED_BRANCH_COLUMNS, Recorder, Store, StoreError, StoreLockedError


def make_episode(n_steps: int = 2, episode_id: str = "ep1") -> Episode:
    ep = Episode(id=episode_id, task_id="mock:kv_0", model="scripted", settings=RunSettings())
    for i in range(n_steps):
        branches = [
            Branch(index=0, action_text="<tool_call>...", kind="call", call=Call(name="get", arguments={"key": "a"}),
                   predicted={"value": 1}, predicted_text='{"value": 1}', actual={"value": 1},
                   actual_source="committed", actual_error=False, chosen=True, scores={"judge": 0.9},
                   metrics=Metrics(json_valid=True, exact=True, field_f1=1.0, error_agree=True, surprise=0.25)),
            Branch(index=1, action_text="oops", kind="parse_error", parse_error="bad", sampled=True),
            Branch(index=2, action_text="<tool_call>...", kind="call", call=Call(name="set", arguments={"key": "b"}),
                   actual={"ok": True}, actual_source="shadow", actual_error=False, sampled=True,
                   shadow_state_after={"a": i, "b": None}),
            Branch(index=3, action_text="<tool_call>...", kind="call", call=Call(name="set", arguments={"key": "c"}),
                   sampled=True, not_executed="shadow execution off"),
        ]
        ep.steps.append(Step(index=i, turn=0, branches=branches, chosen=0, kind="call",
                             state_before={"a": i}, state_after={"a": i + 1}, rehearsals=1, external_calls=1))
        ep.external_calls += 1
    return ep


def test_round_trip_episode(tmp_path):
    store = Store(tmp_path / "t.db")
    ep = make_episode()
    for step in ep.steps:
        store.add_step(ep, step)
    loaded = store.get_episode("ep1")
    assert loaded.model_dump() == ep.model_dump()
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    rows = store.list_episodes(mode="parallel")
    assert [r["id"] for r in rows] == ["ep1"] and rows[0]["n_steps"] == 2
    assert store.list_episodes(mode="none") == []


def test_a_database_from_before_the_shadow_columns_opens_and_gains_them(tmp_path):
    path = tmp_path / "old.db"
    store = Store(path)
    ep = make_episode(1)
    store.add_step(ep, ep.steps[0])
    store.db["branches"].transform(drop=set(ADDED_BRANCH_COLUMNS))  # the schema before these columns
    store.close()
    conn = sqlite3.connect(path)
    assert not set(ADDED_BRANCH_COLUMNS) & {c[1] for c in conn.execute("PRAGMA table_info(branches)")}
    conn.close()
    reopened = Store(path)
    assert set(ADDED_BRANCH_COLUMNS) <= set(reopened.db["branches"].columns_dict)
    old = reopened.get_episode("ep1").steps[0].branches
    assert [(b.shadow_state_after, b.not_executed) for b in old] == [(None, None)] * 4
    assert old[2].actual == {"ok": True} and old[2].actual_source == "shadow"
    new = make_episode(2)
    reopened.add_step(new, new.steps[1])
    assert reopened.get_episode("ep1").steps[1].branches[2].shadow_state_after == {"a": 1, "b": None}


def test_get_branch_carries_the_step_state_before(tmp_path):
    store = Store(tmp_path / "t.db")
    ep = make_episode(1)
    store.add_step(ep, ep.steps[0])
    row, branch = store.get_branch(store.branch_rows("ep1")[2]["id"])
    assert row["state_before"] == {"a": 0} and branch.shadow_state_after == {"a": 0, "b": None}


def test_step_write_is_atomic(tmp_path, monkeypatch):
    store = Store(tmp_path / "t.db")
    ep = make_episode(1)
    real = Store._branch_row

    def fail_on_second_branch(episode_id, step_id, step_idx, b):
        if b.index == 1:
            raise RuntimeError("crash mid-step")
        return real(episode_id, step_id, step_idx, b)

    monkeypatch.setattr(Store, "_branch_row", staticmethod(fail_on_second_branch))
    with pytest.raises(RuntimeError, match="crash mid-step"):
        store.add_step(ep, ep.steps[0])
    assert store.db["steps"].count == 0 and store.db["branches"].count == 0
    assert store.db["episodes"].count == 0


def test_annotation_requires_existing_branch(tmp_path):
    store = Store(tmp_path / "t.db")
    ep = make_episode(1)
    store.add_step(ep, ep.steps[0])
    branch_id = store.branch_rows("ep1")[0]["id"]
    ann_id = store.add_annotation(Annotation(branch_id=branch_id, label="minor", corrected_predicted={"value": 2},
                                             note="off by one", annotator="ana"))
    row = store.annotations(branch_id)[0]
    assert row["id"] == ann_id and row["label"] == "minor" and row["corrected_predicted"] == '{"value": 2}'
    with pytest.raises(StoreError, match="no branch"):
        store.add_annotation(Annotation(branch_id=9999, label="match"))


def test_unknown_episode_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="no episode"):
        Store(tmp_path / "t.db").get_episode("nope")


def test_locked_database_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("app.store.BUSY_TIMEOUT_S", 0.1)
    path = tmp_path / "t.db"
    store = Store(path)
    store.db.conn.execute("PRAGMA busy_timeout = 100")
    ep = make_episode(2)
    recorder = Recorder(store)
    recorder.start(ep)
    blocker = sqlite3.connect(path)
    blocker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    recorder(ep, ep.steps[0])
    assert recorder.pending == [ep.steps[0]] and "locked" in recorder.last_error
    with pytest.raises(StoreLockedError, match="nothing was written"):
        recorder.flush(ep)
    assert store.db["steps"].count == 0
    blocker.rollback()
    blocker.close()
    recorder(ep, ep.steps[1])  # the lock is gone: both steps land, in order
    assert recorder.pending == []
    assert [s.index for s in store.get_episode("ep1").steps] == [0, 1]


def test_a_writer_that_holds_the_lock_briefly_is_waited_for(tmp_path):
    path = tmp_path / "t.db"
    store = Store(path)
    ep = make_episode(1)
    blocker = sqlite3.connect(path, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    releasing = threading.Event()

    def release() -> None:  # another writer, done after a second
        releasing.set()  # before the rollback: once the lock is gone, this is already set
        blocker.rollback()

    threading.Timer(1.0, release).start()
    recorder = Recorder(store)
    recorder(ep, ep.steps[0])  # waits on the busy timeout, then writes
    assert releasing.is_set()  # it returned only after the other writer let go
    assert recorder.pending == [] and recorder.last_error is None  # written, not kept back as locked
    assert [s.index for s in store.get_episode("ep1").steps] == [0]


@pytest.fixture(params=["tmpfs", "page-limit"])
def full_store(request, tmp_path):
    """A store whose disk fills up: a real 512 KiB tmpfs (we are root), or SQLite's page limit."""
    if request.param == "tmpfs":
        where = tmp_path / "tiny"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        yield Store(where / "full.db")
        subprocess.run(["umount", "-l", str(where)], check=False)
    else:
        store = Store(tmp_path / "limited.db")
        store.db.execute("PRAGMA max_page_count = 120")
        yield store


def test_a_full_disk_is_a_clear_error_and_loses_no_earlier_data(full_store):
    store = full_store
    big = {"blob": "x" * 20_000}
    saved = []
    with pytest.raises(StoreError, match="full"):
        for i in range(200):
            ep = make_episode(1, episode_id=f"ep{i}")
            ep.steps[0].state_before = {**big, "i": i}
            store.add_step(ep, ep.steps[0])
            saved.append(ep.id)
    assert len(saved) >= 2
    for episode_id in saved:  # every earlier step is intact and readable
        assert store.get_episode(episode_id).steps[0].state_before["i"] == int(episode_id[2:])
    assert store.db.execute("pragma integrity_check").fetchone()[0] == "ok"


def test_end_reason_and_ahead_seconds_round_trip_and_an_older_database_gains_them(tmp_path):
    from app.store import ADDED_EPISODE_COLUMNS, ADDED_STEP_COLUMNS

    path = tmp_path / "old.db"
    store = Store(path)
    ep = make_episode(1)
    store.add_step(ep, ep.steps[0])
    store.db["steps"].transform(drop=set(ADDED_STEP_COLUMNS))  # the schema before these columns
    store.db["episodes"].transform(drop={"end_reason"})
    store.close()
    reopened = Store(path)
    assert {"ahead_s"} <= set(reopened.db["steps"].columns_dict)
    assert set(ADDED_EPISODE_COLUMNS) <= set(reopened.db["episodes"].columns_dict)
    old = reopened.get_episode("ep1")
    assert old.end_reason is None and old.steps[0].ahead_s == 0.0
    new = make_episode(2)
    new.steps[1].ahead_s, new.steps[1].duration_s = 4.25, 0.05
    new.status, new.end_reason = "stopped", "stopped"
    reopened.add_step(new, new.steps[1])
    loaded = reopened.get_episode("ep1")
    assert loaded.end_reason == "stopped" and loaded.steps[1].ahead_s == 4.25 and loaded.steps[1].compute_s == 4.3


def test_a_rehearsal_keeps_its_source_and_replacing_an_episode_leaves_one(tmp_path):
    path = tmp_path / "old.db"
    store = Store(path)
    store.replace_episode(make_episode(1, "src"))
    store.db["episodes"].transform(drop={"source_episode"})  # a database from before rehearsals
    store.close()
    store = Store(path)
    assert store.get_episode("src").source_episode is None
    first = make_episode(2, "src~rh").model_copy(update={"source_episode": "src"})
    assert store.replace_episode(first) is False
    branch = store.branch_id_at("src~rh", 0)
    store.add_annotation(Annotation(branch_id=branch, label="match"))
    again = make_episode(1, "src~rh").model_copy(update={"source_episode": "src"})
    assert store.replace_episode(again) is True
    loaded = store.get_episode("src~rh")
    assert loaded.source_episode == "src" and len(loaded.steps) == 1
    assert store.db["steps"].count_where("episode_id = ?", ["src~rh"]) == 1
    assert store.annotations() == []  # the replaced rehearsal's annotation went with its branch
    assert [r["id"] for r in store.find_episodes() if r["source_episode"] == "src"] == ["src~rh"]
