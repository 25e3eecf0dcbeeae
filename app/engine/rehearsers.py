"""Rehearsers: what fills in a candidate call's response before the selector scores it.

- `ModelRehearser`: the policy predicts each response (the Rehearse role, one batched pass).
  This is EnvACE: no real call is spent.
- `ForkRehearser`: each call runs for real on its own fork of the pre-step state. Reality
  stands in for the prediction: the "real best-of-K" baseline, whose executions are the
  agent's own calls (`executes = True`: counted as external calls, never as shadow calls).

A rehearser fills `Branch.predicted*` (model) or `Branch.actual*` with `actual_source="shadow"`
(fork) for every call branch that has neither, and records what the step needs later in the
`StepContext` (prompts for the surprise score, forks for outcome scoring). The model reads the step's
conversation (`ctx.history`) through the step's planner (`ctx.planner`); forks need the episode's
environment (`ctx.episode`), so the `ForkRehearser` runs in an episode only.
"""
from __future__ import annotations

from typing import Protocol

from app.engine.context import StepContext
from app.engine.history import rehearse_step_prompt
from app.formats import REHEARSE_STOP, parse_result
from app.records import Branch
from model_backend.base import GenerationConfig


class Rehearser(Protocol):
    name: str
    executes: bool
    """True when rehearsing runs the call for real (on a fork): each one is an external call."""

    def rehearse(self, ctx: StepContext, branches: list[Branch]) -> int:
        """Fill in the response of every call branch not yet rehearsed; returns the predictions made."""
        ...


class ModelRehearser:
    """The policy's Rehearse role predicts every response in one batched pass."""

    name = "model"
    executes = False

    def rehearse(self, ctx: StepContext, branches: list[Branch]) -> int:
        planner = ctx.planner
        settings = planner.settings
        todo = [b for b in branches if b.kind == "call" and b.predicted_text is None]
        if not todo:
            return 0
        for b in todo:  # the real transitions each prediction is conditioned on (shown on its card)
            b.memory = planner.recall(b.call)
        # The one rule of what a Rehearse prompt shows, also the training rows' (a replayed step's).
        prompts = [rehearse_step_prompt(ctx.tools.get(b.call.name), b.call, ctx.history, ctx.state_before,
                                        settings.rehearsal_context, constrain=settings.constrain, examples=b.memory)
                   for b in todo]
        config = GenerationConfig(max_new_tokens=settings.max_rehearsal_tokens, temperature=0.0,
                                  seed=settings.seed, stop=REHEARSE_STOP)
        for branch, prompt, gen in zip(todo, prompts, planner.policy.rehearse(prompts, config)):
            branch.predicted_text = gen.text
            branch.predicted, error = parse_result(gen.text)
            ctx.predicted_valid[branch.index] = error is None
            ctx.rehearse_prompts[branch.index] = prompt
        return len(todo)


class ForkRehearser:
    """Every call runs on its own fork of the pre-step state; the forks stay in `ctx.forks`."""

    name = "fork"
    executes = True

    def rehearse(self, ctx: StepContext, branches: list[Branch]) -> int:
        for b in branches:
            if b.kind == "call" and b.call is not None and b.actual_source is None:
                fork = ctx.require_episode("the fork rehearser (real best-of-K)").env.fork()
                result = fork.call(b.call.name, b.call.arguments)
                b.actual, b.actual_error, b.actual_source = result.output, result.error, "shadow"
                b.shadow_state_after = fork.state()
                ctx.forks[b.index] = fork
        return 0  # nothing was predicted


__all__ = ["ForkRehearser", "ModelRehearser", "Rehearser"]
