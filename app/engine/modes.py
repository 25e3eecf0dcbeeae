"""Rehearsal modes: how one step proposes candidates, rehearses them and picks the one to commit.

Each mode is a function `(ctx) -> chosen index` that leaves every branch of the step in
`ctx.branches`; the table of them by name is `strategies.MODE_TABLE`. They propose and
rehearse through the step's planner (`ctx.planner`: `generate`, `parse_branches`, `rehearse`)
and score and choose through the planner's selector, so a mode knows nothing of which
rehearser or selector it is given.

- `none`: the greedy action, committed without rehearsal.
- `parallel`: K candidates in one batch, all rehearsed in one batch, the selector picks.
- `sequential`: rehearse one; while the rehearsal foresees failure, propose again with the
  rehearsals in view (at most K attempts).
"""
from __future__ import annotations

from typing import Any

from app.engine import selection
from app.engine.context import StepContext


def none(ctx: StepContext) -> int:
    planner = ctx.planner
    ctx.branches = planner.parse_branches(ctx, planner.generate(ctx, 1))
    return 0


def parallel(ctx: StepContext) -> int:
    planner = ctx.planner
    ctx.branches = planner.parse_branches(ctx, planner.generate(ctx, planner.settings.branches))
    planner.rehearse(ctx, ctx.branches)
    planner.selector.score(ctx, ctx.branches)
    chosen = planner.selector.choose(ctx, ctx.branches)
    if planner.settings.keep_primary and planner.selector.name != "oracle":
        chosen = selection.keep_primary(ctx.branches, chosen)
    return chosen


def sequential(ctx: StepContext) -> int:
    planner = ctx.planner
    selector = planner.selector
    memory: list[tuple[Any, Any]] = []
    for attempt in range(planner.settings.branches):
        # From the second attempt on, a sampled alternative stands in when greedy repeats itself.
        generations = planner.generate(ctx, 1 if attempt == 0 else 2, memory=memory or None, attempt=attempt)
        new = planner.parse_branches(ctx, generations)[:1]
        if not new:
            continue
        branch = new[0]
        ctx.branches.append(branch)
        if branch.kind != "call":
            if branch.kind == "answer":
                return branch.index
            continue
        planner.rehearse(ctx, [branch])
        selector.score(ctx, [branch])
        if not selection.predicts_failure(branch, selector.name, branch.scores.get(selector.score_key, 0)):
            return branch.index
        memory.append((branch.call, branch.predicted))
    if not ctx.branches:  # every attempt repeated an earlier one: commit the greedy primary
        ctx.seen = {}
        ctx.branches = planner.parse_branches(ctx, planner.generate(ctx, 1))
        return 0
    return selection.choose(ctx.branches, selector.score_key)


__all__ = ["none", "parallel", "sequential"]
