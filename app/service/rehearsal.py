"""Rehearsing stored episodes with a world model, for the CLI (`python -m app rehearse`) and the Traces tab.

Checks everything it can before the model works (the episodes exist, each has a recorded call, its task can be
rebuilt), then rehearses episode by episode (`app.engine.trace_rehearsal`), writing each rehearsal whole in one
transaction once it is complete: a model that fails mid-episode leaves nothing of that episode. A rehearsal of the
same episode by the same model and adapter replaces the earlier one (same id); one that carries annotations is
kept unless the caller says to replace it (`replace_annotated`), and the error says so. Every recorded result
joins the rehearsal memory (`remember`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from app.engine.trace_rehearsal import (MAX_ALTERNATIVES, recorded_calls, recorded_transitions, rehearsal_id,
                                        rehearse_episode)
from app.records import Episode, Step, Transition
from app.service.catalog import episode_task, task_env
from app.service.forms import InputError
from app.store import Store, StoreError

Remember = Callable[[list[Transition]], list[Transition]]
Progress = Callable[[int, int, str], None]
"""(calls done, calls in all, what is being rehearsed)."""


@dataclass
class RehearsalResult:
    """What `rehearse_episodes` wrote."""

    rehearsals: list[str] = field(default_factory=list)
    """The ids of the rehearsal episodes written, in the order of the sources."""
    replaced: list[str] = field(default_factory=list)
    """Those of them that replaced an earlier rehearsal by the same model."""
    calls: int = 0
    """Recorded calls rehearsed."""
    alternatives: int = 0
    """Alternative branches proposed."""
    remembered: int = 0
    """Recorded results new to the rehearsal memory."""
    seconds: float = 0.0
    """Time in the model's steps (each rehearsed call step's duration), summed."""


def parse_episode_ids(text: str | list[str] | None) -> list[str]:
    """`ID[,ID...]` (or a list of ids) -> ids in order, each once; InputError when there is none."""
    items = text if isinstance(text, list) else (text or "").split(",")
    ids = list(dict.fromkeys(i.strip() for i in items if i and i.strip()))
    if not ids:
        raise InputError("Name at least one episode to rehearse (its id, or several separated by commas).")
    return ids


def rehearsable_ids(store: Store) -> list[str]:
    """Every stored episode that ran or was imported (not a rehearsal itself), newest first."""
    return [r["id"] for r in store.find_episodes(limit=100_000) if not r.get("source_episode")]


def split_rehearsable(store: Store, ids: list[str], model: str, adapter: str | None,
                      replace_annotated: bool = False) -> tuple[list[str], list[str]]:
    """`ids` split into those `check_sources` accepts and, for the others, one line each saying why not (what
    `--all` skips)."""
    ok, skipped = [], []
    for episode_id in ids:
        try:
            check_sources(store, [episode_id], model, adapter, replace_annotated)
            ok.append(episode_id)
        except InputError as exc:
            skipped.append(str(exc))
    return ok, skipped


def check_sources(store: Store, ids: list[str], model: str, adapter: str | None,
                  replace_annotated: bool = False) -> list[tuple[Episode, Any, Any]]:
    """(episode, task, env) per id, or InputError naming the first that cannot be rehearsed (nothing written)."""
    out = []
    for episode_id in ids:
        try:
            ep = store.get_episode(episode_id)
        except StoreError as exc:
            raise InputError(str(exc)) from None
        if ep.source_episode:
            raise InputError(f"episode {ep.id} is itself a rehearsal (of {ep.source_episode}): rehearse its source")
        if ep.status == "running":
            raise InputError(f"episode {ep.id} is still running: rehearse it once it has ended")
        if not recorded_calls(ep):
            raise InputError(f"episode {ep.id} has no recorded tool call with a response to rehearse")
        try:
            task = episode_task(ep)
            env = task_env(task)
        except (ValueError, KeyError) as exc:
            raise InputError(f"episode {ep.id}: its task cannot be rebuilt ({str(exc).splitlines()[0]})") from None
        earlier = rehearsal_id(ep.id, model, adapter)
        n = len(store.annotations_by_position(earlier)) if store.list_episodes(id=earlier) else 0
        if n and not replace_annotated:
            raise InputError(f"episode {ep.id} was rehearsed by this model before ({earlier}) and that rehearsal has "
                             f"{n} annotation(s): rehearsing again would delete them (allow replacing annotated "
                             "rehearsals to go on)")
        out.append((ep, task, env))
    return out


def rehearse_episodes(store: Store, ids: list[str], policy: Any, *, model: str, adapter: str | None,
                      alternatives: int = 0, replace_annotated: bool = False, remember: Remember | None = None,
                      progress: Progress | None = None, **options: Any) -> RehearsalResult:
    """Rehearse the stored episodes `ids` with `policy` (named `model`/`adapter`), each written whole when done.
    `options`: `rehearse_episode`'s (seed, temperature, constrain, token budgets). InputError on bad input (before
    any model call); a model's failure propagates, the episodes finished before it stay written."""
    if not 0 <= alternatives <= MAX_ALTERNATIVES:
        raise InputError(f"alternatives must be 0 to {MAX_ALTERNATIVES}; got {alternatives}")
    sources = check_sources(store, ids, model, adapter, replace_annotated)
    total = sum(len(recorded_calls(ep)) for ep, _, _ in sources)
    result = RehearsalResult()
    done = 0

    def told(step: Step) -> None:
        nonlocal done
        done += 1
        result.seconds += step.duration_s
        if progress is not None:
            progress(done, total, f"{step.chosen_branch.call.name} (step {step.index})")

    if progress is not None:
        progress(0, total, "starting")
    for ep, task, env in sources:
        try:
            rehearsal = rehearse_episode(ep, task, env, policy, model=model, adapter=adapter,
                                         alternatives=alternatives, on_call=told, **options)
        except RuntimeError as exc:
            if not _model_failure(exc):
                raise
            kept = f"; the {len(result.rehearsals)} finished before it are saved" if result.rehearsals else ""
            raise InputError(f"The model failed while rehearsing episode {ep.id}: {str(exc).splitlines()[0]} "
                             f"(nothing of that episode was written{kept})") from None
        if store.replace_episode(rehearsal):
            result.replaced.append(rehearsal.id)
        result.rehearsals.append(rehearsal.id)
        result.calls += len(recorded_calls(rehearsal))
        result.alternatives += sum(len(s.branches) - 1 for s in rehearsal.steps)
        if remember is not None:
            source_kind = "imported" if ep.trace is not None else "committed"
            result.remembered += len(remember(recorded_transitions(ep, task, task_env(task), source_kind)))
    return result


def _model_failure(exc: BaseException) -> bool:
    """A model server's failure (a remote error, a missing capability), not a bug of ours."""
    import model_backend

    return isinstance(exc, (model_backend.RemoteCapabilityError, model_backend.RemoteError))


def summary(result: RehearsalResult) -> str:
    """One line saying what was written."""
    replaced = f" ({len(result.replaced)} replacing an earlier rehearsal by the same model)" if result.replaced else ""
    per_call = f", {result.seconds / result.calls:.2f} s per call" if result.calls else ""
    alternatives = f", {result.alternatives} alternative(s) proposed" if result.alternatives else ""
    return (f"Rehearsed {result.calls} recorded call(s) in {len(result.rehearsals)} episode(s){replaced}"
            f"{alternatives}{per_call}; {result.remembered} recorded result(s) new to the rehearsal memory. "
            f"Rehearsals: {', '.join(result.rehearsals)}")


__all__ = ["RehearsalResult", "check_sources", "parse_episode_ids", "rehearsable_ids",
           "rehearse_episodes", "split_rehearsable", "summary"]
