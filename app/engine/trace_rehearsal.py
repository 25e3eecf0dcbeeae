"""Rehearse a recorded episode offline: what would this world model have predicted at each recorded call?

For every committed call of a stored episode (one that ran, or one imported from a trace file) with its real
response, the model predicts the response from the recorded history (teacher-forced: the history holds the
recorded calls and their recorded responses, never the model's predictions), through the engine's own
`StepPlanner` (its `ModelRehearser`) on the recorded step's tools and history, with no episode, environment or
judge (as `world_model.WorldModel` does), so prompts, constrained decoding, parsing, metrics and surprise have
one owner. Optionally the model also proposes K
alternatives at that step (Act, as a parallel step does): "what would this model have done here?"; they have no
actual response (`NOT_EXECUTED_RECORDED`).

The result is a new `Episode` linked to its source (`Episode.source_episode`): the recorded steps, each call
step's committed branch holding the recorded call, its recorded response and this model's prediction with its
metrics, so the Annotate, Dashboard and Fine-tune tabs read it as any episode (an imported trace's record,
`Episode.trace`, comes along: its task is rebuilt from it). Its id is fixed by (source, model,
adapter) (`rehearsal_id`): rehearsing again with the same model replaces the earlier rehearsal.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Callable

from app.engine.memory import observed
from app.engine.planner import StepPlanner
from app.engine.replay import replay
from app.envs.base import Environment, Task
from app.formats import branch_key, canonical_json
from app.records import Episode, Metrics, RunSettings, Step, Transition, TransitionSource, utcnow
from model_backend.base import Policy

NOT_EXECUTED_RECORDED = "a recorded trace: an alternative the model proposed is never executed"
MAX_ALTERNATIVES = 8


def adapter_key(adapter: str | None) -> str:
    """An adapter as the rehearsal id reads it: the real path of a directory (the same adapter named relative
    to another working directory is the same), else the name as given; "" for none."""
    if not adapter:
        return ""
    return os.path.realpath(adapter) if os.path.isdir(adapter) else adapter


def rehearsal_id(source_id: str, model: str, adapter: str | None) -> str:
    """The id of `source_id`'s rehearsal by (model, adapter): the same for every rehearsal by the same model, so a
    second one replaces the first instead of adding a duplicate."""
    digest = hashlib.sha1(canonical_json([model.strip(), adapter_key(adapter)]).encode()).hexdigest()[:8]
    return f"{source_id}~rh-{digest}"


def recorded_calls(episode: Episode) -> list[Step]:
    """The steps whose committed branch is a call with a recorded response: what a rehearsal predicts."""
    return [s for s in episode.steps if s.chosen_branch.kind == "call" and s.chosen_branch.call is not None
            and s.chosen_branch.actual_source is not None]


def rehearse_episode(source: Episode, task: Task, env: Environment, policy: Policy, *, model: str, adapter: str | None,
                     alternatives: int = 0, seed: int = 0, temperature: float = 0.8, constrain: bool = True,
                     max_rehearsal_tokens: int = 128, max_action_tokens: int = 96,
                     on_call: Callable[[Step], None] | None = None) -> Episode:
    """`source` rehearsed by `policy` (named `model`/`adapter` on the result), teacher-forced on its recorded
    history; `task`/`env`: the source's task and a fresh environment of it, whose tools per turn are read (nothing
    is executed). `alternatives`: K calls the model proposes at each recorded call (0: none). `on_call` is told of
    each rehearsed call step. ValueError: nothing to rehearse, or K out of range."""
    if not 0 <= alternatives <= MAX_ALTERNATIVES:
        raise ValueError(f"alternatives must be 0 to {MAX_ALTERNATIVES}; got {alternatives}")
    if not recorded_calls(source):
        raise ValueError(f"episode {source.id} has no recorded tool call with a response to rehearse")
    settings = RunSettings(mode="parallel" if alternatives else "none", branches=alternatives + 1,
                           selector="logprob", seed=seed, temperature=temperature, shadow=False,
                           tool_choice=source.settings.tool_choice, constrain=constrain, relevance=0.0,
                           max_action_tokens=max_action_tokens, max_rehearsal_tokens=max_rehearsal_tokens,
                           memory="off")
    episode = Episode(id=rehearsal_id(source.id, model, adapter), task_id=source.task_id, model=model,
                      adapter=adapter, settings=settings, status="running", source_episode=source.id,
                      turn_results=[t.model_copy(deep=True) for t in source.turn_results],
                      trace=source.trace.model_copy(deep=True) if source.trace is not None else None)
    planner = StepPlanner(policy, settings)
    for view in replay(source, task, env):
        recorded = view.step.chosen_branch.model_copy(deep=True, update={
            "index": 0, "chosen": True, "predicted_text": None, "predicted": None, "metrics": Metrics(),
            "memory": [], "scores": {}, "duplicates": 0, "sampled": False, "act_logprob": None})
        step = Step(index=view.step.index, turn=view.step.turn, branches=[recorded], chosen=0, kind=view.step.kind,
                    state_before=view.step.state_before, state_after=view.step.state_after)
        if recorded.kind == "call" and recorded.call is not None and recorded.actual_source is not None:
            started = time.perf_counter()
            # Teacher-forced: the recorded step's tools and history.
            ctx = planner.context(view.step.index, view.tools, view.history, view.step.state_before)
            ctx.branches = [recorded]
            ctx.seen[branch_key(recorded.kind, recorded.call, recorded.action_text)] = recorded
            planner.rehearse(ctx, [recorded])
            if alternatives:  # the greedy action and K-1 sampled; one equal to the recorded call folds into it
                fresh = planner.parse_branches(ctx, planner.generate(ctx, alternatives))
                for b in fresh:
                    if b.kind == "call":
                        b.not_executed = NOT_EXECUTED_RECORDED
                ctx.branches += fresh
                planner.rehearse(ctx, fresh)
            planner.measure(ctx)  # the recorded branch only: the alternatives have no actual response
            step.branches, step.rehearsals = ctx.branches, ctx.rehearsals
            step.duration_s = round(time.perf_counter() - started, 3)
            if on_call is not None:
                on_call(step)
        episode.steps.append(step)
    episode.rehearsals = sum(s.rehearsals for s in episode.steps)
    episode.status, episode.end_reason, episode.finished_at = "finished", source.end_reason, utcnow()
    return episode


def recorded_transitions(source: Episode, task: Task, env: Environment, source_kind: TransitionSource) -> list[Transition]:
    """The source's recorded calls with their real responses, as rehearsal-memory transitions of `source_kind`
    (`committed` for an episode that ran here, `imported` for a trace brought in from a file)."""
    out: list[Transition] = []
    for view in replay(source, task, env):
        step = view.step.model_copy(update={"branches": [view.step.chosen_branch]})
        for t in observed(step, task_id=source.task_id, split=task.extra.get("split"), episode_id=source.id,
                          tools={tool.name: tool for tool in view.tools}):
            out.append(t.model_copy(update={"source": source_kind}))
    return out


__all__ = ["MAX_ALTERNATIVES", "NOT_EXECUTED_RECORDED", "adapter_key", "recorded_calls", "recorded_transitions",
           "rehearsal_id", "rehearse_episode"]
