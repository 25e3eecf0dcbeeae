"""Comparing two episodes step by step (the Traces tab's side-by-side view)."""
from __future__ import annotations

from app.formats import branch_key
from app.records import Episode, Step


def committed_key(step: Step) -> str:
    """What a step did, for comparing two episodes: the committed call, answer or parse error."""
    b = step.chosen_branch
    return branch_key(b.kind, b.call, b.action_text)


def first_difference(a: Episode, b: Episode) -> int | None:
    """Index of the first step where the two episodes committed different actions (None: none)."""
    for i, (sa, sb) in enumerate(zip(a.steps, b.steps)):
        if committed_key(sa) != committed_key(sb):
            return i
    if len(a.steps) != len(b.steps):
        return min(len(a.steps), len(b.steps))
    return None
