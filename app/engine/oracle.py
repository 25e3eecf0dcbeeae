"""The "real best-of-K" baseline: the K candidates executed for real, the best by outcome committed.

The ceiling a perfect world model would reach, paid for with one external call per
executed candidate. Evaluation only: the outcome is judged against the turn's ground
truth, which no agent sees. It is configuration, not a runner of its own:
`oracle_settings(...)` (`mode="parallel"`, `selector="oracle"`, no shadow), for which
`strategies.rehearser_for` picks the `ForkRehearser`.

A step: Act proposes K candidates exactly as in parallel mode (same seeds, same dedup) ->
every call runs on its own fork of the pre-step state (reality stands in for the
rehearsal; each is an external call) -> `OutcomeSelector` scores each branch by its real
outcome -> the best is committed (it returns on the real environment what it returned on
its fork, and is counted once).
"""
from __future__ import annotations

import copy
from typing import Any, Callable

from app import envs
from app.engine.context import EpisodeView, StepContext
from app.engine.selection import PARSE_ERROR_SCORE, choose
from app.envs.base import Environment
from app.formats import canonical_call
from app.records import Branch, Call, RunSettings

ORACLE = "oracle"
# Outcome scores, best first; ties go to the lower index (the greedy primary), as in `selection.choose`.
TURN_PASSES = 3.0
"""The turn's check passes right after this branch (for an answer: the turn is done now)."""
GOLD_CALL = 2.0
"""The call equals one of the turn's ground-truth calls not yet made."""
CALL_OK = 1.0
"""The call ran without error."""
CALL_ERROR = 0.0
"""The call returned an error: the agent at least sees why."""
EARLY_ANSWER = -1.0
"""An answer that ends the turn before its check passes: the turn is lost."""


def call_matches(call: Call | None, gold_calls: list[str], param_names: Callable[[str], list[str]] | None) -> bool:
    """The call equals (canonical name + arguments) one of the turn's ground-truth calls."""
    if call is None:
        return False
    return canonical_call(call) in gold_keys(gold_calls, param_names)


def gold_keys(gold_calls: list[str], param_names: Callable[[str], list[str]] | None) -> list[str]:
    """Canonical keys of ground-truth call strings (BFCL's `mv(source='a', ...)`), parsed with `ast`."""
    keys = []
    for gold in gold_calls:
        name, args = envs.parse_call_string(gold, param_names)
        keys.append(canonical_call(Call(name=name, arguments=args)))
    return keys


def oracle_settings(base: RunSettings) -> RunSettings:
    """The best-of-K twin of a parallel setting: same K, seed and budgets; outcome selector, no shadow."""
    return base.model_copy(update={"mode": "parallel", "selector": ORACLE, "shadow": False})


class OutcomeSelector:
    """Scores each branch by its real outcome on its fork (`ForkRehearser` ran it); the best is committed.

    Needs the forks: the planner refuses `selector="oracle"` with a rehearser that does not execute. Needs the
    episode (`ctx.episode`: its judge, task and turn): a step planned outside one is refused (ValueError).
    """

    name = score_key = ORACLE

    def score(self, ctx: StepContext, branches: list[Branch]) -> None:
        for b in branches:
            b.scores[ORACLE] = self._outcome(ctx, b)

    def choose(self, ctx: StepContext, branches: list[Branch]) -> int:
        return choose(branches, ORACLE)

    def _outcome(self, ctx: StepContext, b: Branch) -> float:
        episode = ctx.require_episode("the outcome selector (oracle)")
        if b.kind == "parse_error":
            return PARSE_ERROR_SCORE
        if b.kind == "answer":
            return TURN_PASSES if _turn_passes(episode, episode.env, episode.turn_executed) else EARLY_ANSWER
        assert b.call is not None
        executed = episode.turn_executed + [(b.call.name, b.call.arguments, b.actual)]
        if _turn_passes(episode, ctx.forks[b.index], executed):
            return TURN_PASSES
        if canonical_call(b.call) in _remaining_gold(episode):
            return GOLD_CALL
        return CALL_ERROR if b.actual_error else CALL_OK


def _turn_passes(episode: EpisodeView, env: Environment, executed: list[tuple[str, dict[str, Any], Any]]) -> bool:
    """The turn's check on `env` if the turn ended now (on a copy of the judge: checks replay gold)."""
    judge = copy.deepcopy(episode.judge, {id(episode.task): episode.task})
    return judge.check_turn(episode.turn, env, executed).success


def _remaining_gold(episode: EpisodeView) -> list[str]:
    """The turn's ground-truth calls (canonical) minus those already committed, as a multiset."""
    truth = episode.task.ground_truth or []
    gold = truth[episode.turn] if episode.turn < len(truth) else []
    keys = gold_keys(gold, episode.env.param_names)
    for name, args, _ in episode.turn_executed:
        key = canonical_call(Call(name=name, arguments=args))
        if key in keys:
            keys.remove(key)
    return keys


__all__ = ["ORACLE", "OutcomeSelector", "call_matches", "gold_keys", "oracle_settings"]
