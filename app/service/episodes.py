"""Stored episodes the Traces tab acts on: what discarding one would delete, asked before it is deleted."""
from __future__ import annotations

from dataclasses import dataclass

from app.service.catalog import INSTRUCTION_PREFIX
from app.service.forms import InputError
from app.store import Store, StoreError

DISCARDABLE = ("interrupted", "stopped", "failed")
"""Statuses an episode may be discarded in (a finished one is a result; a running one is someone's run)."""


def success_text(status: str, success: int | bool | None, task_id: str) -> str:
    """The Traces table's success cell: the judge's result, or in a few words why there is none (a typed instruction
    has no expected result; an episode is judged at its end)."""
    if success is not None:
        return "yes" if success else "no"
    if task_id.startswith(INSTRUCTION_PREFIX):
        return "none: a typed instruction"
    if status == "running":
        return "not yet: running"
    if status in ("stopped", "interrupted"):
        return f"not judged: {status}"
    if status == "failed":
        return "not judged: failed"
    return "not judged: no judge"


@dataclass(frozen=True)
class DiscardPlan:
    """An episode that may be discarded, with what discarding it deletes."""

    episode_id: str
    task_id: str
    status: str
    steps: int
    annotations: int

    def question(self) -> str:
        """What the person confirms: every count the delete removes."""
        notes = f"{self.annotations} annotation{'' if self.annotations == 1 else 's'}"
        return (f"Delete episode {self.episode_id} (task {self.task_id}, {self.status}): its {self.steps} "
                f"step{'' if self.steps == 1 else 's'} and {notes} go with it, and cannot be brought back.")


def plan_discard(store: Store, episode_id: str | None) -> DiscardPlan:
    """What discarding `episode_id` would delete; InputError when there is none, or it may not be discarded."""
    if not episode_id:
        raise InputError("Pick an episode first (click a row of the table, or choose its id).")
    try:
        ep = store.get_episode(episode_id)
        annotations = len(store.annotations_by_position(ep.id))
    except StoreError as exc:
        raise InputError(str(exc)) from None
    if ep.status not in DISCARDABLE:
        raise InputError(f"Episode {ep.id} is {ep.status}: only an interrupted, stopped or failed episode can be "
                         "discarded.")
    return DiscardPlan(ep.id, ep.task_id, ep.status, len(ep.steps), annotations)


def discard(store: Store, plan: DiscardPlan) -> str:
    """Delete the episode of a confirmed `plan` with its steps, branches and annotations, when it is still what
    the person confirmed (InputError otherwise, and nothing is deleted); returns what was deleted."""
    now = plan_discard(store, plan.episode_id)
    if now != plan:
        raise InputError(f"Episode {plan.episode_id} changed since you asked (now {now.status}, {now.steps} step(s), "
                         f"{now.annotations} annotation(s)): nothing was deleted; press Discard again.")
    try:
        store.delete_episode(plan.episode_id)
    except StoreError as exc:
        raise InputError(f"Nothing was deleted: {exc}") from None
    return (f"Episode {plan.episode_id} ({plan.status}, {plan.steps} step(s), {plan.annotations} annotation(s)) "
            "discarded.")
