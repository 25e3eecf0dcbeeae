"""The "real best-of-K" baseline: the K candidates executed for real, the best by outcome committed.

The ceiling a perfect world model would reach, paid for with one external call per
executed candidate. Evaluation only: the outcome is judged against the turn's ground
truth, which no agent sees. Settings: `mode="parallel"`, `selector="oracle"`, no shadow.

A step: Act proposes K candidates exactly as in parallel mode (same seeds, same dedup) ->
every call runs on its own fork of the pre-step state (reality stands in for the
rehearsal) -> each branch is scored by its real outcome -> the best is committed.
"""
from __future__ import annotations

import copy
import logging
from typing import Any, Callable

from app import envs
from app.engine.runner import EpisodeRunner
from app.engine.selection import PARSE_ERROR_SCORE
from app.envs.base import Environment, Tool
from app.formats import canonical_call, canonical_json
from app.records import Branch, Call, RunSettings

log = logging.getLogger(__name__)

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


class BestOfKRunner(EpisodeRunner):
    """An EpisodeRunner whose "rehearsal" is real execution on forks and whose selector is the outcome.

    Non-chosen calls keep their real (fork) response with `actual_source="shadow"`; they are
    counted as external calls, not shadow calls, because here they are the agent's own
    calls. The committed call runs on the episode's environment, which is in the forks'
    pre-step state, so it returns what its fork returned; it is counted once.
    """

    def __init__(self, task: Any, policy: Any, settings: RunSettings, **kwargs: Any) -> None:
        if settings.mode != "parallel" or settings.selector != ORACLE or settings.shadow:
            raise ValueError("BestOfKRunner needs mode=parallel, selector=oracle, shadow=False "
                             "(see oracle_settings)")
        super().__init__(task, policy, settings, **kwargs)
        self._forks: dict[int, Environment] = {}

    def _rehearse(self, branches: list[Branch], tools: dict[str, Tool]) -> int:
        self._forks = {}
        for b in branches:
            if b.kind == "call" and b.call is not None:
                fork = self.env.fork()
                result = fork.call(b.call.name, b.call.arguments)
                b.actual, b.actual_error, b.actual_source = result.output, result.error, "shadow"
                b.shadow_state_after = fork.state()
                self._forks[b.index] = fork
        return 0  # nothing was predicted

    def _score(self, branches: list[Branch]) -> None:
        for b in branches:
            b.scores[ORACLE] = self._outcome(b)

    def _commit(self, branch: Branch) -> int:
        executed, self._forks = len(self._forks), {}
        if branch.kind != "call":
            return super()._commit(branch) + executed
        on_fork = canonical_json(branch.actual)
        branch.shadow_state_after = None  # committed: the step's own state_after shows its effect
        super()._commit(branch)
        if canonical_json(branch.actual) != on_fork:
            log.warning("%s: %s returned differently on its fork and for real", self.task.id, branch.call.name)
        return executed

    # ------------------------------------------------------------ outcome

    def _outcome(self, b: Branch) -> float:
        if b.kind == "parse_error":
            return PARSE_ERROR_SCORE
        if b.kind == "answer":
            return TURN_PASSES if self._turn_passes(self.env, self._turn_executed) else EARLY_ANSWER
        assert b.call is not None
        executed = self._turn_executed + [(b.call.name, b.call.arguments, b.actual)]
        if self._turn_passes(self._forks[b.index], executed):
            return TURN_PASSES
        if canonical_call(b.call) in self._remaining_gold():
            return GOLD_CALL
        return CALL_ERROR if b.actual_error else CALL_OK

    def _turn_passes(self, env: Environment, executed: list[tuple[str, dict[str, Any], Any]]) -> bool:
        """The turn's check on `env` if the turn ended now (on a copy of the judge: checks replay gold)."""
        judge = copy.deepcopy(self.judge, {id(self.task): self.task})
        return judge.check_turn(self.turn, env, executed).success

    def _remaining_gold(self) -> list[str]:
        """The turn's ground-truth calls (canonical) minus those already committed, as a multiset."""
        gold = (self.task.ground_truth or [])[self.turn] if self.turn < len(self.task.ground_truth or []) else []
        keys = gold_keys(gold, getattr(self.env, "param_names", None))
        for name, args, _ in self._turn_executed:
            key = canonical_call(Call(name=name, arguments=args))
            if key in keys:
                keys.remove(key)
        return keys


__all__ = ["BestOfKRunner", "ORACLE", "call_matches", "gold_keys", "oracle_settings"]
