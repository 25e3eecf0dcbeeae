"""Episode traces as JSONL: export stored episodes with their annotations, import them into another database.

One line per episode: `{"format": "envace-episode/1", "episode": Episode, "annotations":
[TraceAnnotation]}`, written from the records' own `model_dump()`. Annotations are addressed
by step and branch index (row ids differ between databases).

Import checks everything before it writes anything: the file's size, each line's size,
JSON, the record schema (the same pydantic models the engine writes), that every step and
annotation points at something that exists, and that no episode id repeats. Then the store
writes all episodes in one transaction, so a bad line or a locked database leaves the
database as it was.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

from pydantic import BaseModel, Field, ValidationError

from app.records import Annotation, Episode
from app.store import Store
from app.trace_io.imported import TraceFileError, json_lines, read_bounded, size_text

FORMAT = "envace-episode/1"
MAX_IMPORT_BYTES = 64 * 2**20
"""Largest file `import` reads (64 MiB: a few thousand BFCL episodes with their states)."""
MAX_LINE_BYTES = 8 * 2**20
"""Largest single episode line (an 8 MiB episode is a sign of a wrong file, not a long run)."""


class TraceAnnotation(Annotation):
    """An annotation as it travels between databases: addressed by position, not by row id."""

    branch_id: int = Field(0, exclude=True)
    """Row ids differ between databases: not written; the import sets it."""
    step: int
    """Index of the annotated branch's step in the episode."""
    branch: int
    """Index of the annotated branch in its step."""

    def to_annotation(self) -> Annotation:
        return Annotation(branch_id=0, **self.model_dump(exclude={"step", "branch"}))


class TraceRecord(BaseModel):
    """One line of a trace file."""

    format: Literal["envace-episode/1"]
    episode: Episode
    annotations: list[TraceAnnotation] = []


@dataclass
class ImportResult:
    imported: list[str]
    skipped: list[str]
    annotations: int


# ---------------------------------------------------------------- export


def export_episodes(store: Store, out: str | os.PathLike[str], episode_ids: Iterable[str] | None = None) -> int:
    """Write the episodes (default: all, oldest first) to `out`, replaced atomically; returns how many."""
    ids = list(episode_ids) if episode_ids is not None else [r["id"] for r in reversed(store.list_episodes())]
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for episode_id in ids:
                ep = store.get_episode(episode_id)
                annotations = [TraceAnnotation(step=s, branch=b, **a.model_dump(exclude={"branch_id"}))
                               for s, b, a in store.annotations_by_position(episode_id)]
                record = TraceRecord(format=FORMAT, episode=ep, annotations=annotations)
                f.write(json.dumps(record.model_dump(mode="json"), ensure_ascii=False) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)  # an unknown id or a full disk leaves no half-written file
    return len(ids)


# ---------------------------------------------------------------- import


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def _check_references(record: TraceRecord, line: int) -> None:
    ep = record.episode
    for position, step in enumerate(ep.steps):
        if step.index != position:
            raise TraceFileError(f"line {line}: episode {ep.id}: step {position} has index {step.index}")
        if not 0 <= step.chosen < len(step.branches):
            raise TraceFileError(f"line {line}: episode {ep.id}: step {step.index} chooses branch {step.chosen} "
                                 f"of {len(step.branches)}")
        indexes = [b.index for b in step.branches]
        if len(set(indexes)) != len(indexes):
            raise TraceFileError(f"line {line}: episode {ep.id}: step {step.index} repeats a branch index")
    branches = {(s.index, b.index) for s in ep.steps for b in s.branches}
    for ann in record.annotations:
        if (ann.step, ann.branch) not in branches:
            raise TraceFileError(f"line {line}: episode {ep.id}: an annotation points at step {ann.step}, "
                                 f"branch {ann.branch}, which the episode does not have")


SQLITE_INT = (-2**63, 2**63 - 1)
"""The range of an SQLite INTEGER column; a typed integer field outside it cannot be stored."""


def _check_integers(model: BaseModel, line: int, where: str = "") -> None:
    """Every integer field of the record's models (not the free-form JSON values inside them, stored as text) fits
    SQLite's 64-bit INTEGER, so a valid file never fails half-way through its import."""
    for name, value in model:
        path = f"{where}.{name}" if where else name
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            at = f"{path}[{i}]" if isinstance(value, list) else path
            if isinstance(item, BaseModel):
                _check_integers(item, line, at)
            elif isinstance(item, int) and not isinstance(item, bool) and not SQLITE_INT[0] <= item <= SQLITE_INT[1]:
                raise TraceFileError(f"line {line}: {at} = {item} is outside the 64-bit integer range a database "
                                     "column holds")


def _check_corrections(record: TraceRecord, line: int) -> None:
    """A corrected action is a call of a tool of its step with schema-valid arguments, or a plain answer marked as
    such (`corrected_action_kind: "answer"`); an episode whose task cannot be rebuilt here has its calls checked
    for form only (the tools are not known)."""
    from app.service.annotations import episode_tools
    from app.service.forms import InputError, check_corrected_action

    tools: dict[int, list | None] = {}
    for ann in record.annotations:
        text = (ann.corrected_action or "").strip()
        if not text:
            continue
        step = record.episode.steps[ann.step]
        if ann.corrected_action_kind != "answer" and step.turn not in tools:
            try:
                tools[step.turn] = episode_tools(record.episode, ann.step)
            except InputError:
                tools[step.turn] = None
        known = tools.get(step.turn)
        try:
            kind = check_corrected_action(text, ann.corrected_action_kind == "answer",
                                          known if known is not None else [])
        except InputError as exc:
            if known is None and "unknown tool" in str(exc):
                continue  # the task is not known here: its tools cannot be checked
            raise TraceFileError(f"line {line}: episode {record.episode.id}: the annotation on step {ann.step}, "
                                 f"branch {ann.branch}: {exc}") from None
        ann.corrected_action_kind = kind  # type: ignore[assignment]


def parse_traces(data: bytes, max_bytes: int = MAX_IMPORT_BYTES) -> list[TraceRecord]:
    """Validate a whole trace file; raises TraceFileError naming the first problem."""
    if len(data) > max_bytes:
        raise TraceFileError(f"the file is {size_text(len(data))}; the limit is {size_text(max_bytes)}")
    records: list[TraceRecord] = []
    seen: set[str] = set()
    for line_no, value in json_lines(data, MAX_LINE_BYTES, unit="episode"):
        if not isinstance(value, dict) or value.get("format") != FORMAT:
            raise TraceFileError(f"line {line_no}: not an EnvACE episode record (expected \"format\": \"{FORMAT}\"; "
                                 "TRL rows from `export --format trl` are for training, not for import)")
        try:
            record = TraceRecord.model_validate(value)
        except ValidationError as exc:
            raise TraceFileError(f"line {line_no}: {_first_error(exc)}") from None
        _check_integers(record, line_no)
        _check_references(record, line_no)
        _check_corrections(record, line_no)
        if record.episode.id in seen:
            raise TraceFileError(f"line {line_no}: episode {record.episode.id} appears twice in the file")
        seen.add(record.episode.id)
        records.append(record)
    if not records:
        raise TraceFileError("the file holds no episodes")
    return records


def read_trace_file(path: str | os.PathLike[str], max_bytes: int = MAX_IMPORT_BYTES) -> list[TraceRecord]:
    """`parse_traces` on a file, refusing an oversized one before reading it."""
    return parse_traces(read_bounded(path, max_bytes), max_bytes)


FOREIGN_FORMATS: tuple[str, ...] = ("openai", "otlp")
"""Formats of other software's traces (`import --format`): chat JSONL (`openai_chat`) and OTLP/JSON (`otlp`)."""


def parse_foreign(data: bytes, fmt: str, file: str = "", max_bytes: int = MAX_IMPORT_BYTES) -> list[TraceRecord]:
    """A whole foreign trace file as records (episodes without annotations), checked in full; TraceFileError names
    the first bad line or span."""
    from app.trace_io.openai_chat import parse_openai
    from app.trace_io.otlp import parse_otlp

    if len(data) > max_bytes:
        raise TraceFileError(f"the file is {size_text(len(data))}; the limit is {size_text(max_bytes)}")
    if fmt not in FOREIGN_FORMATS:
        raise TraceFileError(f"unknown format {fmt!r}; known: {', '.join(FOREIGN_FORMATS)}")
    episodes = parse_openai(data, file) if fmt == "openai" else parse_otlp(data, file)
    if not episodes:
        raise TraceFileError("the file holds no traces")
    seen: dict[str, str] = {}
    for ep in episodes:
        where = ep.trace.trace_id if ep.trace else ep.id
        if ep.id in seen:
            raise TraceFileError(f"{where}: the same trace as {seen[ep.id]} (episode {ep.id} twice)")
        seen[ep.id] = where
    return [TraceRecord(format=FORMAT, episode=ep) for ep in episodes]


def read_foreign(path: str | os.PathLike[str], fmt: str, max_bytes: int = MAX_IMPORT_BYTES) -> list[TraceRecord]:
    """`parse_foreign` on a file, refusing an oversized one before reading it."""
    return parse_foreign(read_bounded(path, max_bytes), fmt, Path(path).name, max_bytes)


def export_otlp(store: Store, out: str | os.PathLike[str], episode_ids: Iterable[str] | None = None) -> int:
    """The episodes (default: all, oldest first) as OTLP/JSON lines (`otlp.write_otlp`); returns how many."""
    from app.trace_io.otlp import write_otlp

    ids = list(episode_ids) if episode_ids is not None else [r["id"] for r in reversed(store.list_episodes())]
    return write_otlp((store.get_episode(i) for i in ids), out)


def import_records(store: Store, records: list[TraceRecord], skip_existing: bool = False) -> ImportResult:
    """Write validated records in one transaction (StoreError, nothing written, on a clash or a lock)."""
    items = [(r.episode, [(a.step, a.branch, a.to_annotation()) for a in r.annotations]) for r in records]
    imported, skipped = store.import_episodes(items, skip_existing=skip_existing)
    landed = set(imported)
    n = sum(len(r.annotations) for r in records if r.episode.id in landed)
    return ImportResult(imported, skipped, n)


__all__ = ["FOREIGN_FORMATS", "FORMAT", "ImportResult", "export_otlp", "parse_foreign", "read_foreign", "MAX_IMPORT_BYTES", "MAX_LINE_BYTES", "TraceAnnotation", "TraceFileError",
           "TraceRecord", "export_episodes", "import_records", "parse_traces", "read_trace_file"]
