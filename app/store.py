"""SQLite storage (sqlite-utils): episodes, steps, branches, annotations, adapters.

WAL mode, foreign keys on, and one transaction per step, so a crash never leaves half a
step. Rows are written from the records' own `model_dump()`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterator

import sqlite_utils

from app.formats import canonical_call, canonical_json
from app.records import (Annotation, Branch, Call, Episode, MemoryHit, Metrics, RunSettings, Step, TraceSource,
                         Transition, TurnResult, utcnow)

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another writer before giving up (sqlite's busy handler retries)."""
SETTINGS_COLUMNS = ("mode", "branches", "selector", "seed", "temperature", "shadow", "rehearsal_context")
METRIC_COLUMNS = ("json_valid", "exact", "field_f1", "error_agree", "surprise")
ADDED_BRANCH_COLUMNS = {"shadow_state_after": str, "not_executed": str, "memory": str}
ADDED_ANNOTATION_COLUMNS = {"corrected_action_kind": str, "corrected_predicted_set": int}
"""`corrected_predicted_set`: the corrected response is set (a JSON `null` one too, stored as SQL NULL);
NULL in rows written before it, read as "set when the value is not null" (`Annotation`)."""
ADDED_EPISODE_COLUMNS = {"writer": str, "end_reason": str, "trace": str, "source_episode": str}
"""`writer`: `host:pid` of the process writing a running episode, so a later start can tell a
dead writer (the episode was interrupted) from a live one (another process is still at it); `end_reason`:
`Episode.end_reason`; `trace`: `Episode.trace` (JSON) of an imported trace; `source_episode`:
`Episode.source_episode` (a rehearsal's recorded episode)."""
ADDED_STEP_COLUMNS = {"ahead_s": float}
ADDED_ADAPTER_COLUMNS = {"is_default": int, "default_reason": str}
"""`is_default`: the adapter a run and the next fine-tune start from (at most one row; none: the shipped one);
`default_reason`: why a fine-tune's child was made the default or not (its other tools' unseen calls)."""
WRITER = f"{socket.gethostname()}:{os.getpid()}"
"""Branch columns newer than the first schema: added to an older database when it opens."""


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


class StoreError(RuntimeError):
    """A storage problem the user can act on (message says what to do)."""


class StoreFullError(StoreError):
    """The disk (or the database's size limit) is full: the write was rolled back."""


class StoreLockedError(StoreError):
    pass


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _unjson(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class Store:
    """One SQLite file. Thread-safe (one connection guarded by a lock) for the UI's worker threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        self.db = sqlite_utils.Database(conn)
        self._lock = threading.RLock()
        self._guard(self._create_schema)

    def close(self) -> None:
        self.db.close()

    def _guard(self, fn, *args, **kwargs):
        """Run a database operation under the lock; turn a locked database into a clear error."""
        with self._lock:
            try:
                return fn(*args, **kwargs)
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    raise StoreLockedError(
                        f"database {self.path} is locked by another writer (waited {BUSY_TIMEOUT_S:.0f} s); "
                        "nothing was written, retry when it is free") from exc
                if "full" in str(exc):
                    raise StoreFullError(f"database {self.path}: the disk is full; this write was rolled back "
                                         "(everything saved before it is intact): free some space and retry") from exc
                raise

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        """One write transaction, taken with BEGIN IMMEDIATE: a busy database is waited for (the
        busy timeout) at the start. A deferred BEGIN would read first and then fail at once when
        another writer holds the lock (SQLite does not wait to upgrade a read transaction)."""
        conn = self.db.conn
        if conn.in_transaction:  # nested: a savepoint inside the caller's transaction
            with self.db.atomic():
                yield
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            conn.rollback()
            raise
        try:
            conn.execute("COMMIT")
        except BaseException:
            conn.rollback()
            raise

    # ---------------------------------------------------------------- schema

    def _create_schema(self) -> None:
        db = self.db
        if self.path != ":memory:":
            db.enable_wal()
        db.execute("PRAGMA foreign_keys = ON")
        db["episodes"].create({
            "id": str, "task_id": str, "model": str, "adapter": str, "mode": str, "branches": int,
            "selector": str, "seed": int, "temperature": float, "shadow": int, "rehearsal_context": str,
            "settings": str, "status": str, "success": int, "turn_results": str, "external_calls": int,
            "shadow_calls": int, "rehearsals": int, "n_steps": int, "created_at": str,
            "finished_at": str, "error": str, **ADDED_EPISODE_COLUMNS,
        }, pk="id", if_not_exists=True, defaults={"n_steps": 0, "external_calls": 0,
                                                   "shadow_calls": 0, "rehearsals": 0})
        db["steps"].create({
            "id": int, "episode_id": str, "idx": int, "turn": int, "chosen": int, "kind": str,
            "state_before": str, "state_after": str, "rehearsals": int, "shadow_calls": int,
            "external_calls": int, "duration_s": float, "created_at": str, **ADDED_STEP_COLUMNS,
        }, pk="id", foreign_keys=[("episode_id", "episodes", "id")], if_not_exists=True)
        db["branches"].create({
            "id": int, "step_id": int, "episode_id": str, "step_idx": int, "idx": int, "kind": str,
            "action_text": str, "call_name": str, "call_arguments": str, "parse_error": str,
            "sampled": int, "act_logprob": float, "predicted_text": str, "predicted": str,
            "actual": str, "actual_source": str, "actual_error": int, "scores": str,
            "json_valid": int, "exact": int, "field_f1": float, "error_agree": int,
            "surprise": float, "chosen": int, "duplicates": int, **ADDED_BRANCH_COLUMNS,
        }, pk="id", foreign_keys=[("step_id", "steps", "id"), ("episode_id", "episodes", "id")],
            if_not_exists=True)
        for table, added in (("branches", ADDED_BRANCH_COLUMNS), ("episodes", ADDED_EPISODE_COLUMNS),
                             ("steps", ADDED_STEP_COLUMNS)):
            have = db[table].columns_dict
            for name, kind in added.items():
                if name not in have:
                    db[table].add_column(name, kind)
        db["annotations"].create({
            "id": int, "branch_id": int, "label": str, "corrected_action": str,
            "corrected_predicted": str, "note": str, "annotator": str, "created_at": str,
            **ADDED_ANNOTATION_COLUMNS,
        }, pk="id", foreign_keys=[("branch_id", "branches", "id")], if_not_exists=True)
        have = db["annotations"].columns_dict
        for name, kind in ADDED_ANNOTATION_COLUMNS.items():
            if name not in have:
                db["annotations"].add_column(name, kind)
        db["transitions"].create({
            "id": int, "tool": str, "env_class": str, "call_key": str, "arguments": str, "response": str,
            "response_key": str, "error": int, "read_only": int, "source": str, "task_id": str, "split": str,
            "episode_id": str, "episode_key": str, "step": int, "branch": int, "created_at": str,
        }, pk="id", if_not_exists=True)
        # One row per distinct (call, response) a source saw in a task's episode: replays add nothing new, and an
        # episode keeps its own observations (a rehearsal may always see what its episode observed).
        db["transitions"].create_index(["call_key", "response_key", "source", "task_id", "episode_key"], unique=True,
                                       if_not_exists=True)
        db["transitions"].create_index(["tool"], if_not_exists=True)
        db["adapters"].create({
            "id": str, "path": str, "parent": str, "base_model": str, "data": str,
            "metrics": str, "created_at": str, **ADDED_ADAPTER_COLUMNS,
        }, pk="id", if_not_exists=True)
        have = db["adapters"].columns_dict
        for name, kind in ADDED_ADAPTER_COLUMNS.items():
            if name not in have:
                db["adapters"].add_column(name, kind)
        db["finetune_runs"].create({
            "id": int, "adapter_id": str, "parent": str, "status": str, "config": str,
            "data": str, "losses": str, "metrics": str, "started_at": str, "finished_at": str, "error": str,
        }, pk="id", if_not_exists=True)
        for table, cols in (("steps", ["episode_id", "idx"]), ("branches", ["step_id"]),
                            ("branches", ["episode_id"]), ("annotations", ["branch_id"])):
            db[table].create_index(cols, if_not_exists=True, unique=(table == "steps"))

    # ---------------------------------------------------------------- writes

    @staticmethod
    def _episode_row(ep: Episode) -> dict[str, Any]:
        s = ep.settings
        row = {name: getattr(s, name) for name in SETTINGS_COLUMNS}
        row.update(id=ep.id, task_id=ep.task_id, model=ep.model, adapter=ep.adapter,
                   settings=_json(s.model_dump()), status=ep.status,
                   success=None if ep.success is None else int(ep.success),
                   turn_results=_json([t.model_dump() for t in ep.turn_results]),
                   external_calls=ep.external_calls, shadow_calls=ep.shadow_calls,
                   rehearsals=ep.rehearsals, n_steps=len(ep.steps), created_at=ep.created_at,
                   finished_at=ep.finished_at, error=ep.error, end_reason=ep.end_reason,
                   trace=_json(ep.trace.model_dump()) if ep.trace is not None else None,
                   source_episode=ep.source_episode, writer=WRITER if ep.status == "running" else None)
        row["shadow"] = int(row["shadow"])
        return row

    def save_episode(self, ep: Episode) -> None:
        """Insert or update the episode row (not its steps)."""
        def write():
            with self._atomic():
                self.db["episodes"].upsert(self._episode_row(ep), pk="id")
        self._guard(write)

    def add_step(self, ep: Episode, step: Step) -> int:
        """Write one step with its branches and the episode's counters, in one transaction."""
        def write() -> int:
            with self._atomic():
                self.db["episodes"].upsert(self._episode_row(ep), pk="id")
                return self._insert_step(ep.id, step)
        return self._guard(write)

    def _insert_step(self, episode_id: str, step: Step) -> int:
        """The step row and its branch rows (inside the caller's transaction); returns the step's row id."""
        step_id = self.db["steps"].insert({
            "episode_id": episode_id, "idx": step.index, "turn": step.turn, "chosen": step.chosen,
            "kind": step.kind, "state_before": _json(step.state_before),
            "state_after": _json(step.state_after), "rehearsals": step.rehearsals,
            "shadow_calls": step.shadow_calls, "external_calls": step.external_calls,
            "duration_s": step.duration_s, "ahead_s": step.ahead_s, "created_at": step.created_at,
        }).last_pk
        self.db["branches"].insert_all(self._branch_row(episode_id, step_id, step.index, b) for b in step.branches)
        return step_id

    def import_episodes(self, items: list[tuple[Episode, list[tuple[int, int, Annotation]]]],
                        skip_existing: bool = False) -> tuple[list[str], list[str]]:
        """Write whole episodes with their annotations, all in one transaction (all or nothing).

        `items`: (episode, [(step index, branch index, annotation)]); an annotation's
        `branch_id` is ignored and set to the new row id of its branch. An episode id the
        database already holds is an error (nothing written) unless `skip_existing`.
        Returns (imported ids, skipped ids).
        """
        def write() -> tuple[list[str], list[str]]:
            imported, skipped = [], []
            with self._atomic():
                for ep, annotations in items:
                    if self.db["episodes"].count_where("id = ?", [ep.id]):
                        if skip_existing:
                            skipped.append(ep.id)
                            continue
                        raise StoreError(f"episode {ep.id} is already in {self.path}; nothing was imported "
                                         "(skip the episodes already present to import the rest)")
                    self.db["episodes"].insert(self._episode_row(ep))
                    for step in ep.steps:
                        self._insert_step(ep.id, step)
                    ids = {(r["step_idx"], r["idx"]): r["id"] for r in self.db.query(
                        "select id, step_idx, idx from branches where episode_id = ?", [ep.id])}
                    self.db["annotations"].insert_all(self._annotation_row(ann, ids[(step_index, branch_index)])
                                                      for step_index, branch_index, ann in annotations)
                    imported.append(ep.id)
            return imported, skipped
        return self._guard(write)

    def annotations_by_position(self, episode_id: str) -> list[tuple[int, int, Annotation]]:
        """An episode's annotations as (step index, branch index, Annotation), oldest first."""
        sql = ("select a.*, b.step_idx, b.idx as branch_idx from annotations a join branches b on b.id = a.branch_id "
               "where b.episode_id = ? order by a.id")

        def read() -> list[tuple[int, int, Annotation]]:
            out = []
            for r in self.db.query(sql, [episode_id]):
                r = dict(r)
                position = (r.pop("step_idx"), r.pop("branch_idx"))
                out.append((*position, self.annotation_from_row(r)))
            return out
        return self._guard(read)

    @staticmethod
    def _branch_row(episode_id: str, step_id: int, step_idx: int, b: Branch) -> dict[str, Any]:
        row = {"step_id": step_id, "episode_id": episode_id, "step_idx": step_idx, "idx": b.index,
               "kind": b.kind, "action_text": b.action_text,
               "call_name": b.call.name if b.call else None,
               "call_arguments": _json(b.call.arguments) if b.call else None,
               "parse_error": b.parse_error, "sampled": int(b.sampled), "act_logprob": b.act_logprob,
               "predicted_text": b.predicted_text, "predicted": _json(b.predicted),
               "actual": _json(b.actual), "actual_source": b.actual_source,
               "actual_error": None if b.actual_error is None else int(b.actual_error),
               "shadow_state_after": _json(b.shadow_state_after), "not_executed": b.not_executed,
               "scores": _json(b.scores), "chosen": int(b.chosen), "duplicates": b.duplicates,
               "memory": _json([h.model_dump() for h in b.memory]) if b.memory else None}
        for name in METRIC_COLUMNS:
            value = getattr(b.metrics, name)
            row[name] = int(value) if isinstance(value, bool) else value
        return row

    @staticmethod
    def annotation_from_row(row: dict[str, Any]) -> Annotation:
        """An `annotations` row (any extra columns ignored) as an Annotation; a row written before the
        `corrected_predicted_set` flag reads a non-null response as set."""
        fields = {k: row.get(k) for k in Annotation.model_fields if k in row}
        fields["corrected_predicted"] = _unjson(row.get("corrected_predicted"))
        fields["note"], fields["annotator"] = row.get("note") or "", row.get("annotator") or ""
        return Annotation(**fields)

    @staticmethod
    def _annotation_row(annotation: Annotation, branch_id: int | None = None) -> dict[str, Any]:
        row = annotation.model_dump()
        row["corrected_predicted"] = _json(row["corrected_predicted"]) if annotation.corrected_predicted_set else None
        row["corrected_predicted_set"] = int(annotation.corrected_predicted_set)
        if branch_id is not None:
            row["branch_id"] = branch_id
        return row

    def add_annotation(self, annotation: Annotation) -> int:
        row = self._annotation_row(annotation)

        def write() -> int:
            with self._atomic():
                if not self.db["branches"].count_where("id = ?", [annotation.branch_id]):
                    raise StoreError(f"no branch with id {annotation.branch_id}")
                return self.db["annotations"].insert(row).last_pk
        return self._guard(write)

    # ---------------------------------------------------------------- transitions (the rehearsal memory)

    def add_transitions(self, transitions: list[Transition]) -> list[Transition]:
        """Write real (call, response) pairs in one transaction; one already held (same call, response, source,
        task and episode) is not written twice. Returns the transitions that were new, with their row ids."""
        def write() -> list[Transition]:
            added = []
            with self._atomic():
                for t in transitions:
                    row = {"tool": t.tool, "env_class": t.env_class, "arguments": _json(t.arguments),
                           "call_key": canonical_call(Call(name=t.tool, arguments=t.arguments)),
                           "response": _json(t.response), "response_key": canonical_json(t.response),
                           "error": int(t.error), "read_only": int(t.read_only), "source": t.source,
                           "task_id": t.task_id or "", "split": t.split, "episode_id": t.episode_id,
                           "episode_key": t.episode_id or "", "step": t.step, "branch": t.branch, "created_at": utcnow()}
                    cursor = self.db.execute(
                        f"insert or ignore into transitions ({', '.join(row)}) values ({', '.join('?' * len(row))})",
                        list(row.values()))
                    if cursor.rowcount:
                        added.append(t.model_copy(update={"id": cursor.lastrowid}))
            return added
        return self._guard(write)

    def transitions(self, *, sources: tuple[str, ...] | None = None, after_id: int = 0) -> list[Transition]:
        """Stored transitions (of `sources`, newer than row `after_id`), oldest first."""
        where, params = "id > ?", [after_id]
        if sources is not None:
            where += f" and source in ({', '.join('?' * len(sources))})"
            params += list(sources)

        def read() -> list[Transition]:
            return [_transition_from_row(dict(r)) for r in
                    self.db.query(f"select * from transitions where {where} order by id", params)]
        return self._guard(read)

    def transition_counts(self) -> dict[str, int]:
        """Stored transitions by source."""
        def read() -> dict[str, int]:
            return {r["source"]: r["n"] for r in
                    self.db.query("select source, count(*) as n from transitions group by source")}
        return self._guard(read)

    # ---------------------------------------------------------------- reads

    def mark_interrupted(self) -> list[str]:
        """Running episodes whose writer died (a killed server or CLI on this host, or a writer from
        before the column existed) become `interrupted`; their ids. Live writers are left alone."""
        def write() -> list[str]:
            found = []
            for row in self.db.query("select id, writer from episodes where status = 'running'"):
                host, _, pid = (row["writer"] or "").rpartition(":")
                if row["writer"] and (host != socket.gethostname() or _alive(int(pid or 0))):
                    continue  # another machine's (cannot tell) or a live process's
                found.append(row["id"])
            with self._atomic():
                for episode_id in found:
                    self.db["episodes"].update(episode_id, {"status": "interrupted", "end_reason": "interrupted",
                                                            "writer": None})
            return found
        return self._guard(write)

    def replace_episode(self, ep: Episode) -> bool:
        """Write a whole episode with its steps in one transaction, in place of the episode of the same id (its
        steps, branches and annotations deleted first) when there is one; returns whether one was replaced."""
        def write() -> bool:
            with self._atomic():
                found = bool(self.db["episodes"].count_where("id = ?", [ep.id]))
                if found:
                    self._delete_rows(ep.id)
                self.db["episodes"].insert(self._episode_row(ep))
                for step in ep.steps:
                    self._insert_step(ep.id, step)
                return found
        return self._guard(write)

    def _delete_rows(self, episode_id: str) -> None:
        self.db.execute("delete from annotations where branch_id in "
                        "(select id from branches where episode_id = ?)", [episode_id])
        for table in ("branches", "steps"):
            self.db.execute(f"delete from {table} where episode_id = ?", [episode_id])
        self.db.execute("delete from episodes where id = ?", [episode_id])

    def delete_episode(self, episode_id: str) -> None:
        """Remove an episode with its steps, branches and their annotations (one transaction)."""
        def write() -> None:
            with self._atomic():
                self._delete_rows(episode_id)
        self._guard(write)

    def list_episodes(self, **filters: Any) -> list[dict[str, Any]]:
        """Episode rows, newest first; filters are column=value (None values ignored)."""
        where = {k: v for k, v in filters.items() if v is not None}
        clause = " and ".join(f"[{k}] = :{k}" for k in where) or None
        return self._guard(lambda: list(self.db["episodes"].rows_where(clause, where or None,
                                                                          order_by="created_at desc, rowid desc")))

    def branch_rows(self, episode_id: str) -> list[dict[str, Any]]:
        return self._guard(lambda: list(self.db["branches"].rows_where(
            "episode_id = ?", [episode_id], order_by="step_idx, idx")))

    def get_episode(self, episode_id: str) -> Episode:
        def read() -> Episode:
            try:
                row = self.db["episodes"].get(episode_id)
            except sqlite_utils.db.NotFoundError:
                raise StoreError(f"no episode with id {episode_id}") from None
            steps = list(self.db["steps"].rows_where("episode_id = ?", [episode_id], order_by="idx"))
            by_step: dict[int, list[Branch]] = {}
            for b in self.db["branches"].rows_where("episode_id = ?", [episode_id], order_by="step_idx, idx"):
                by_step.setdefault(b["step_id"], []).append(_branch_from_row(b))
            return Episode(
                id=row["id"], task_id=row["task_id"], model=row["model"], adapter=row["adapter"],
                settings=RunSettings.from_stored(_unjson(row["settings"])), status=row["status"],
                success=None if row["success"] is None else bool(row["success"]),
                turn_results=[TurnResult(**t) for t in _unjson(row["turn_results"]) or []],
                external_calls=row["external_calls"], shadow_calls=row["shadow_calls"],
                rehearsals=row["rehearsals"], created_at=row["created_at"],
                finished_at=row["finished_at"], error=row["error"], end_reason=row.get("end_reason"),
                trace=TraceSource.model_validate(_unjson(row["trace"])) if row.get("trace") else None,
                source_episode=row.get("source_episode"),
                steps=[Step(index=s["idx"], turn=s["turn"], chosen=s["chosen"], kind=s["kind"],
                            branches=by_step.get(s["id"], []),
                            state_before=_unjson(s["state_before"]) or {},
                            state_after=_unjson(s["state_after"]) or {}, rehearsals=s["rehearsals"],
                            shadow_calls=s["shadow_calls"], external_calls=s["external_calls"],
                            duration_s=s["duration_s"], ahead_s=s.get("ahead_s") or 0.0,
                            created_at=s["created_at"]) for s in steps])
        return self._guard(read)

    def annotation_records(self, branch_id: int) -> list[Annotation]:
        """A branch's annotations, oldest first, as Annotations (the flags of older rows read as `Annotation` says)."""
        return [self.annotation_from_row(r) for r in self.annotations(branch_id)]

    def annotations(self, branch_id: int | None = None) -> list[dict[str, Any]]:
        if branch_id is None:
            return self._guard(lambda: list(self.db["annotations"].rows))
        return self._guard(lambda: list(self.db["annotations"].rows_where("branch_id = ?", [branch_id])))

    # ---------------------------------------------------------------- reads for the UI (traces, annotate, dashboard)

    @staticmethod
    def _episode_where(alias: str = "e", **filters: Any) -> tuple[str, dict[str, Any]]:
        """A WHERE clause over episodes: equality filters, `task_ids`, `success`, and a date range.

        `success` is "yes", "no" or "unknown" (never judged); `since`/`until` are YYYY-MM-DD
        and inclusive; `task_contains` matches part of the task id.
        """
        clauses, params = [], {}
        for name in ("task_id", "mode", "model", "adapter", "selector"):
            value = filters.get(name)
            if value is not None:
                clauses.append(f"{alias}.[{name}] = :{name}")
                params[name] = value
        if filters.get("task_contains"):
            clauses.append(f"{alias}.task_id like :task_contains")
            params["task_contains"] = f"%{filters['task_contains']}%"
        task_ids = filters.get("task_ids")
        if task_ids is not None:
            names = [f"t{i}" for i in range(len(task_ids))]
            clauses.append(f"{alias}.task_id in ({', '.join(':' + n for n in names)})" if names else "0")
            params.update(zip(names, task_ids))
        success = filters.get("success")
        if success is not None:
            clauses.append({"yes": f"{alias}.success = 1", "no": f"{alias}.success = 0",
                            "unknown": f"{alias}.success is null"}[success])
        if filters.get("since"):
            clauses.append(f"substr({alias}.created_at, 1, 10) >= :since")
            params["since"] = filters["since"]
        if filters.get("until"):
            clauses.append(f"substr({alias}.created_at, 1, 10) <= :until")
            params["until"] = filters["until"]
        return (" and ".join(clauses) or "1"), params

    def find_episodes(self, limit: int = 500, **filters: Any) -> list[dict[str, Any]]:
        """Episode rows, newest first, under `_episode_where` filters."""
        where, params = self._episode_where(**filters)
        sql = f"select e.* from episodes e where {where} order by e.created_at desc, e.rowid desc limit {int(limit)}"
        return self._guard(lambda: [dict(r) for r in self.db.query(sql, params)])

    def episode_values(self, column: str) -> list[Any]:
        """Distinct non-null values of one episode column (for filter choices)."""
        if column not in ("task_id", "mode", "model", "adapter", "selector"):
            raise ValueError(f"not a filterable episode column: {column}")
        sql = f"select distinct [{column}] as v from episodes where [{column}] is not null order by v"
        return self._guard(lambda: [r["v"] for r in self.db.query(sql)])

    def annotation_queue(self, *, diverged: bool = False, unannotated: bool = False, tool: str | None = None,
                         episode_id: str | None = None, limit: int = 500) -> list[dict[str, Any]]:
        """Branches to review, oldest episode step first, with their annotation count.

        Diverged: the rehearsal was not valid JSON, not exact, disagreed on error, or the
        action did not parse.
        """
        clauses, params = [], {}
        if diverged:
            clauses.append("(b.kind = 'parse_error' or b.json_valid = 0 or b.exact = 0 or b.error_agree = 0)")
        if unannotated:
            clauses.append("not exists (select 1 from annotations a where a.branch_id = b.id)")
        if tool:
            clauses.append("b.call_name = :tool")
            params["tool"] = tool
        if episode_id:
            clauses.append("b.episode_id = :episode_id")
            params["episode_id"] = episode_id
        where = " and ".join(clauses) or "1"
        sql = (f"select b.id, b.episode_id, b.step_idx, b.idx, b.kind, b.call_name, b.chosen, b.json_valid, "
               f"b.exact, b.field_f1, b.error_agree, b.actual_source, e.task_id, e.mode, "
               f"(select count(*) from annotations a where a.branch_id = b.id) as n_annotations "
               f"from branches b join episodes e on e.id = b.episode_id where {where} "
               f"order by e.created_at, b.episode_id, b.step_idx, b.idx limit {int(limit)}")
        return self._guard(lambda: [dict(r) for r in self.db.query(sql, params)])

    def branch_tools(self) -> list[str]:
        """Distinct tool names among stored branches."""
        sql = "select distinct call_name from branches where call_name is not null order by call_name"
        return self._guard(lambda: [r["call_name"] for r in self.db.query(sql)])

    def branch_id_at(self, episode_id: str, step: int, branch: int | None = None) -> int:
        """The row id of a branch by position (`branch` None: the step's committed one)."""
        sql = ("select b.id from branches b join steps s on s.id = b.step_id where b.episode_id = ? and b.step_idx = ? "
               + ("and b.idx = ?" if branch is not None else "and b.idx = s.chosen"))
        params = [episode_id, step] + ([branch] if branch is not None else [])
        rows = self._guard(lambda: [r["id"] for r in self.db.query(sql, params)])
        if not rows:
            where = f"branch {branch} of step {step}" if branch is not None else f"step {step}"
            raise StoreError(f"episode {episode_id} has no {where}")
        return int(rows[0])

    def get_branch(self, branch_id: int) -> tuple[dict[str, Any], Branch]:
        """One branch by its row id: its row (with the episode's task and mode, and its step's
        `state_before`, decoded, for the fork's diff) and the record."""
        sql = ("select b.*, e.task_id, e.mode, e.model, e.adapter, s.state_before from branches b "
               "join episodes e on e.id = b.episode_id join steps s on s.id = b.step_id where b.id = ?")

        def read() -> tuple[dict[str, Any], Branch]:
            rows = [dict(r) for r in self.db.query(sql, [branch_id])]
            if not rows:
                raise StoreError(f"no branch with id {branch_id}")
            rows[0]["state_before"] = _unjson(rows[0]["state_before"]) or {}
            return rows[0], _branch_from_row(rows[0])
        return self._guard(read)

    def dashboard_branches(self, **filters: Any) -> list[dict[str, Any]]:
        """Branch metrics joined with their episode's mode/model/adapter/selector, under episode filters."""
        where, params = self._episode_where(**filters)
        sql = (f"select b.id, b.episode_id, b.step_idx, b.idx, b.kind, b.call_name, b.chosen, b.json_valid, "
               f"b.exact, b.field_f1, b.error_agree, b.surprise, b.actual_source, b.actual_error, b.scores, "
               f"e.mode, e.model, e.adapter, e.selector from branches b join episodes e on e.id = b.episode_id "
               f"where {where} order by b.episode_id, b.step_idx, b.idx")
        return self._guard(lambda: [dict(r) for r in self.db.query(sql, params)])

    def annotation_label_counts(self, **filters: Any) -> list[dict[str, Any]]:
        """Annotations per label (None: unlabelled corrections), under episode filters."""
        where, params = self._episode_where(**filters)
        sql = (f"select a.label as label, count(*) as n from annotations a join branches b on b.id = a.branch_id "
               f"join episodes e on e.id = b.episode_id where {where} group by a.label order by n desc")
        return self._guard(lambda: [dict(r) for r in self.db.query(sql, params)])

    def adapter_paths(self) -> list[str]:
        """Paths of registered adapters (for the model picker)."""
        sql = "select path from adapters where path is not null order by created_at"
        return self._guard(lambda: [r["path"] for r in self.db.query(sql)])

    def latest_annotations(self) -> list[dict[str, Any]]:
        """Every annotation row with its branch's episode, step and branch index (`step_idx`, `bidx`) and its own id
        (`aid`), oldest first: a fine-tune keeps the latest per branch."""
        sql = ("select a.id as aid, a.*, b.episode_id, b.step_idx, b.idx as bidx from annotations a "
               "join branches b on b.id = a.branch_id order by a.id")
        return self._guard(lambda: [dict(r) for r in self.db.query(sql)])

    def adapter_id(self, path: str) -> str | None:
        """The registry id of the adapter registered at `path` (resolved), or None."""
        sql = "select id from adapters where path = ?"
        return self._guard(lambda: next((str(r["id"]) for r in self.db.query(sql, [path])), None))

    def register_finetune(self, adapter: dict[str, Any], run: dict[str, Any], make_default: bool) -> int:
        """Register a fine-tuned adapter (`adapters` row) and its run (`finetune_runs` row) in one transaction; with
        `make_default` it becomes the one default adapter. Returns the run's id."""
        def write() -> int:
            with self._atomic():
                if make_default:
                    self.db.execute("update adapters set is_default = 0 where is_default = 1")
                self.db["adapters"].insert({**adapter, "is_default": int(make_default)})
                return int(self.db["finetune_runs"].insert(run).last_pk)
        return self._guard(write)

    def default_adapter(self) -> str | None:
        """The path of the registered adapter made the default (None: none is; the shipped one is)."""
        sql = "select path from adapters where is_default = 1 and path is not null order by created_at desc limit 1"
        return self._guard(lambda: next((r["path"] for r in self.db.query(sql)), None))

    def annotated_episodes(self) -> list[str]:
        """Ids of episodes with at least one annotated branch, newest first (the fine-tune's data picker)."""
        sql = ("select e.id from episodes e where exists (select 1 from annotations a join branches b "
               "on b.id = a.branch_id where b.episode_id = e.id) order by e.created_at desc, e.rowid desc")
        return self._guard(lambda: [r["id"] for r in self.db.query(sql)])

    def annotated_episode_rows(self) -> list[dict[str, Any]]:
        """The same episodes with their task, recorded verdicts (a typed instruction's text) and annotation count."""
        sql = ("select e.id, e.task_id, e.turn_results, (select count(*) from annotations a join branches b "
               "on b.id = a.branch_id where b.episode_id = e.id) as n_annotations from episodes e "
               "where n_annotations > 0 order by e.created_at desc, e.rowid desc")
        return self._guard(lambda: [dict(r) for r in self.db.query(sql)])


def _transition_from_row(r: dict[str, Any]) -> Transition:
    return Transition(tool=r["tool"], arguments=_unjson(r["arguments"]) or {}, response=_unjson(r["response"]),
                      error=bool(r["error"]), read_only=bool(r["read_only"]), env_class=r["env_class"] or "",
                      source=r["source"], task_id=r["task_id"] or None, split=r["split"],
                      episode_id=r["episode_id"], step=r["step"], branch=r["branch"], id=r["id"])


def _branch_from_row(r: dict[str, Any]) -> Branch:
    metrics = {}
    for name in METRIC_COLUMNS:
        value = r[name]
        metrics[name] = bool(value) if value is not None and name not in ("field_f1", "surprise") else value
    return Branch(
        index=r["idx"], action_text=r["action_text"], kind=r["kind"],
        call=Call(name=r["call_name"], arguments=_unjson(r["call_arguments"]) or {}) if r["call_name"] else None,
        parse_error=r["parse_error"], sampled=bool(r["sampled"]), act_logprob=r["act_logprob"],
        predicted_text=r["predicted_text"], predicted=_unjson(r["predicted"]), actual=_unjson(r["actual"]),
        actual_source=r["actual_source"],
        actual_error=None if r["actual_error"] is None else bool(r["actual_error"]),
        shadow_state_after=_unjson(r["shadow_state_after"]), not_executed=r["not_executed"],
        scores=_unjson(r["scores"]) or {}, metrics=Metrics(**metrics), chosen=bool(r["chosen"]),
        duplicates=r["duplicates"] or 0, memory=[MemoryHit(**h) for h in _unjson(r.get("memory")) or []])


class Recorder:
    """Writes an episode's steps as they finish; keeps steps a locked database refused, and retries.

    A locked database therefore loses nothing: the steps wait in memory (and in the
    Episode object) until `flush()` succeeds.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self.pending: list[Step] = []
        self.last_error: str | None = None

    def start(self, ep: Episode) -> None:
        self.store.save_episode(ep)

    def __call__(self, ep: Episode, step: Step) -> None:
        self.pending.append(step)
        try:
            self.flush(ep)
        except StoreLockedError as exc:
            self.last_error = str(exc)
            log.warning("%s; %d step(s) kept in memory", exc, len(self.pending))

    def flush(self, ep: Episode) -> None:
        while self.pending:
            self.store.add_step(ep, self.pending[0])
            self.pending.pop(0)
        self.store.save_episode(ep)
        self.last_error = None


