"""Annotations through the service layer: the tools a corrected action is checked against, saving an
annotation (a corrected response joins the rehearsal memory at once), and the fine-tune's episode picker.

A rejected annotation writes nothing: the form is checked (`forms.build_annotation`) before the store is touched.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from app.engine.memory import corrected
from app.envs import mcp_tasks
from app.envs.base import Tool
from app.records import Annotation, Episode, Transition
from app.service.catalog import INSTRUCTION_PREFIX, episode_task, task_env
from app.service.forms import InputError, build_annotation
from app.store import Store, StoreError
from app.formats import parse_action


@dataclass
class SavedAnnotation:
    id: int
    annotation: Annotation
    remembered: Transition | None = None
    """The corrected response as it joined the rehearsal memory (None: no corrected response of a call, or the
    memory already held that very correction)."""


def episode_tools(episode: Episode, step_index: int) -> list[Tool]:
    """The tools the agent had at step `step_index` of a stored episode (its task rebuilt, its turn entered), or
    an InputError saying why they cannot be known."""
    if not 0 <= step_index < len(episode.steps):
        raise InputError(f"Episode {episode.id} has no step {step_index}.")
    try:
        task = episode_task(episode)
        env = task_env(task)
    except ValueError as exc:
        raise InputError(f"This step's tools cannot be rebuilt: {exc}.") from None
    try:
        env.set_turn(episode.steps[step_index].turn)
        return list(env.tools())
    finally:
        env.close()


INSTRUCTION_BRANCH_USE = ("A typed instruction has no expected result, so this branch is never judged. What a "
                          "correction of it is for: a corrected response joins the rehearsal memory at once (the next "
                          "rehearsal of that call retrieves it) and becomes a Rehearse row of a fine-tune; a corrected "
                          "action becomes an Act row (Fine-tune tab, with this episode picked).")


def branch_use_note(task_id: str) -> str:
    """What annotating a branch of this task's episodes is for, where it is not the usual (a judged task): a typed
    instruction's. Empty for a benchmark task."""
    return INSTRUCTION_BRANCH_USE if task_id.startswith(INSTRUCTION_PREFIX) else ""


def save_annotation(store: Store, branch_id: int, label: str | None, corrected_predicted: str,
                    corrected_action: str, note: str, annotator: str, *, answer: bool = False,
                    remember: Callable[[list[Transition]], list[Transition]] | None = None) -> SavedAnnotation:
    """Check and save one annotation of a stored branch; an InputError (nothing written) says what to fix.

    A corrected action must call a tool of the branch's step with schema-valid arguments, unless `answer` marks it
    as a plain answer. A corrected response of a call (the branch's, or the corrected action's) is handed to
    `remember` (`Services.remember`: the shared rehearsal memory) as a `correction` transition once saved, so the
    next rehearsal of that call retrieves it, before any fine-tune."""
    try:
        row, branch = store.get_branch(branch_id)
    except StoreError as exc:
        raise InputError(str(exc)) from None
    action = (corrected_action or "").strip()
    wants_call = bool(action) and not answer and parse_action(action).kind == "call"
    wants_memory = remember is not None and bool((corrected_predicted or "").strip())
    episode = store.get_episode(row["episode_id"]) if wants_call or wants_memory else None
    tools: list[Tool] | None = None
    if wants_call:
        assert episode is not None
        tools = episode_tools(episode, row["step_idx"])
    annotation = build_annotation(branch_id, label, corrected_predicted, corrected_action, note, annotator,
                                  answer=answer, tools=tools)
    row_id = store.add_annotation(annotation)
    saved = SavedAnnotation(row_id, annotation)
    call = branch.call if branch.kind == "call" else None
    if call is None and annotation.corrected_action_kind == "call":
        call = parse_action(annotation.corrected_action or "").call
    if remember is not None and annotation.corrected_predicted_set and call is not None and episode is not None:
        if tools is None:
            try:
                tools = episode_tools(episode, row["step_idx"])
            except InputError:
                tools = []  # the task cannot be rebuilt: remembered without its tool's class
        task_split = _split(episode)
        tool = next((t for t in tools if t.name == call.name), None)
        transition = corrected(call, annotation.corrected_predicted, tool=tool, task_id=episode.task_id,
                               split=task_split, episode_id=episode.id, step=row["step_idx"], branch=row["idx"])
        added = remember([transition])
        saved.remembered = added[0] if added else None
    return saved


def _split(episode: Episode) -> str | None:
    try:
        return episode_task(episode).extra.get("split")
    except ValueError:
        return None


def episode_label(row: dict[str, Any]) -> str:
    """How an episode reads in a picker: its task's name (a typed instruction's text), then its id."""
    task_id = row.get("task_id") or "?"
    if task_id.startswith(INSTRUCTION_PREFIX) or task_id.endswith(f"/{mcp_tasks.FREE}"):
        text = ""
        for result in json.loads(row.get("turn_results") or "[]"):
            text = text or (result.get("details") or {}).get("instruction") or ""
        where = task_id[len(INSTRUCTION_PREFIX):] if task_id.startswith(INSTRUCTION_PREFIX) else task_id.rsplit("/", 1)[0]
        said = " ".join(text.split())
        name = f"instruction on {where}: “{said[:60]}{'…' if len(said) > 60 else ''}”" if said else \
            f"instruction on {where}"
    else:
        name = task_id
    n = row.get("n_annotations")
    return f"{name} · {row['id']}" + (f" ({n} annotation{'s' if n != 1 else ''})" if n else "")


def annotated_episode_choices(store: Store) -> list[tuple[str, str]]:
    """The fine-tune's episode picker: (task name · id, id) of every annotated episode, newest first."""
    return [(episode_label(r), r["id"]) for r in store.annotated_episode_rows()]


__all__ = ["SavedAnnotation", "annotated_episode_choices", "episode_label", "episode_tools", "save_annotation"]
