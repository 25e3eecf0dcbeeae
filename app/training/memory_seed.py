"""The rehearsal memory's seed: real transitions from the training split, made before any episode runs.

- `expert`: every ground-truth call of every training-split task (BFCL's four multi-turn categories, index
  mod 4 != 3; tau2's own train split), executed in order in a fresh real environment (the engine's
  `replay_ground_truth`, as training's expert episodes are).
- `explore`: before each of those calls, calls sampled on a fork of the state at that point: the same tool
  or another tool of the task, with argument sets the training split's ground truth used for that tool
  elsewhere (so they are plausible, and often wrong for this state: a `cd` into a folder that is not there,
  a stock that is not on the watchlist). Real responses of calls an agent might make, errors included.

Nothing of a held-out task is read: the argument pool comes from training tasks only. `ensure_seed` writes
the seed into a store once (its transitions are deduplicated there), so every later start reads it back.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Callable, Iterable, NamedTuple

from app import envs
from app.engine.replay import GoldCall, ground_truth_calls, replay_ground_truth
from app.envs.base import Task, Tool, ToolResult
from app.formats import canonical_json, in_schema_order
from app.records import Transition

log = logging.getLogger(__name__)

SEED_SUITES = ("bfcl", "tau2")
EXPLORE_PER_CALL = 2
"""Calls explored on forks before each ground-truth call."""


def training_task_ids(suites: Iterable[str] = SEED_SUITES) -> list[str]:
    """Every training-split task of the suites whose tasks have ground truth."""
    ids: list[str] = []
    for suite in suites:
        ids += envs.list_tasks(split="train", suite=suite)
    return ids


def argument_pool(task_ids: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
    """Tool name -> the distinct argument sets the ground truth of `task_ids` calls it with."""
    pool: dict[str, dict[str, dict[str, Any]]] = {}
    for task_id in task_ids:
        task = envs.load_task(task_id)
        env = envs.make_env(task)
        try:
            for _, name, args in ground_truth_calls(task, env):
                pool.setdefault(name, {})[canonical_json(args)] = args
        finally:
            env.close()
    return {name: list(sets.values()) for name, sets in pool.items()}


def _transition(tool: Tool | None, name: str, args: dict[str, Any], result: Any, source: str,
                task: Task) -> Transition:
    return Transition(tool=name, arguments=in_schema_order(args, tool), response=result.output,
                      error=bool(result.error), read_only=bool(tool and tool.read_only),
                      env_class=tool.env_class if tool else "", source=source, task_id=task.id,
                      split=task.extra.get("split"))


class ExploredCall(NamedTuple):
    """A call sampled on a fork of a ground-truth call's state, with its real result."""

    tool: Tool | None
    name: str
    arguments: dict[str, Any]
    result: ToolResult


def explore_calls(env: Any, gold: GoldCall, pool: dict[str, list[dict[str, Any]]], rng: random.Random,
                  n: int = EXPLORE_PER_CALL) -> list[ExploredCall]:
    """`n` calls sampled on forks of the state `gold` meets: half the time `gold`'s own tool, else another tool
    available there, with an argument set the pool holds for it; each with its real result."""
    tools = {t.name: t for t in gold.tools}
    out: list[ExploredCall] = []
    for _ in range(n if env.forkable else 0):
        other = gold.name if rng.random() < 0.5 else rng.choice(sorted(tools))
        choices = pool.get(other) or ([{}] if not tools[other].parameters.get("required") else [])
        if not choices:
            continue
        other_args = rng.choice(choices)
        fork = env.fork()
        try:
            out.append(ExploredCall(tools.get(other), other, other_args, fork.call(other, other_args)))
        finally:
            fork.close()  # a fork may hold a server process (MCP); the declared default does nothing
    return out


def task_transitions(task: Task, pool: dict[str, list[dict[str, Any]]], rng: random.Random,
                     explore: int = EXPLORE_PER_CALL) -> list[Transition]:
    """The ground truth of `task` executed in order (`expert`), and `explore` sampled calls on a fork of the
    state before each gold call (`explore`)."""
    env = envs.make_env(task)
    out: list[Transition] = []

    def explore_before(gold: GoldCall) -> None:
        for tool, name, args, result in explore_calls(env, gold, pool, rng, explore):
            out.append(_transition(tool, name, args, result, "explore", task))

    try:
        for turn in range(len(task.ground_truth or [])):
            for gold in replay_ground_truth(task, env, turn, before=explore_before):
                out.append(_transition(gold.tool, gold.name, gold.arguments, gold.result, "expert", task))
    finally:
        env.close()
    return out


def seed_transitions(task_ids: list[str] | None = None, *, explore: int = EXPLORE_PER_CALL, seed: int = 0,
                     progress: Callable[[int, int], None] | None = None) -> list[Transition]:
    """The whole seed (every training task by default), reproducible for a given `seed`."""
    task_ids = training_task_ids() if task_ids is None else task_ids
    pool = argument_pool(task_ids)
    rng = random.Random(seed)
    out: list[Transition] = []
    for i, task_id in enumerate(task_ids):
        out += task_transitions(envs.load_task(task_id), pool, rng, explore)
        if progress is not None:
            progress(i + 1, len(task_ids))
    return out


def ensure_seed(memory: Any, **kwargs: Any) -> int:
    """Seed `memory` (a `RehearsalMemory`, written through to its store) unless it holds expert transitions
    already; returns the transitions added."""
    if memory.counts().get("expert"):
        return 0
    added = memory.add(seed_transitions(**kwargs))
    log.info("rehearsal memory seeded with %d real transitions of the training split", len(added))
    return len(added)


def open_memory(store: Any, seed: bool = True) -> Any:
    """The rehearsal memory over `store`'s transitions, seeded there first when it has no seed yet
    (BFCL's training split: about 10,000 transitions in a few seconds)."""
    from app.engine.memory import RehearsalMemory

    memory = RehearsalMemory.from_store(store)
    if seed:
        ensure_seed(memory, task_ids=training_task_ids(("bfcl",)))
    return memory


__all__ = ["EXPLORE_PER_CALL", "ExploredCall", "argument_pool", "ensure_seed", "explore_calls", "open_memory",
           "seed_transitions",
           "task_transitions", "training_task_ids"]
