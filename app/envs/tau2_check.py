"""tau2's success check: its own DB comparison on the episode's calls, judged at the end of a turn.

Contract: `Tau2Judge.check_turn(turn, env, executed)` hands the episode's tau2 trajectory (every
call that reached tau2, kept by `Tau2Environment`) to tau2's `EnvironmentEvaluator`: it replays
the trajectory on a fresh domain environment, replays the task's gold actions on another, and
compares the two DB hashes (the agent DB, and on telecom the user's device DB too), then runs the
task's env assertions. Success is that reward times tau2's `ActionEvaluator` reward when the task's
reward basis names ACTION, as tau2's `evaluate_simulation` combines them. Not checked: the
COMMUNICATE basis (the agent's text answers do not reach the environment) and NL assertions
(tau2 judges them with an LLM); `details` says so.

A tau2 task is one conversation, so a check judges the whole episode so far, not one turn's
calls: `judges_whole_episode` tells the runner that the last verdict is the episode's, and that
a person may add user turns after the scripted one.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

from app.envs.base import Executed, Judge, Task, TurnCheck
from app.envs.tau2 import Tau2Environment
from app.envs.tau2_tasks import new_domain_env, parse_task_id, tau2_module, tau2_task

log = logging.getLogger(__name__)

"""The calls the model's environment executed in one turn: (name, args, ToolResult or output)."""

NOT_CHECKED = ("COMMUNICATE", "NL_ASSERTION")
"""Reward bases that need the agent's text or an LLM judge: reported, never part of the verdict."""


class Tau2Judge(Judge):
    """tau2's DB comparison (and action check, where the task asks for it) for one task."""

    judges_whole_episode = True
    """Each check judges the episode so far; the last one is the episode's verdict."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.domain, _ = parse_task_id(task.id)
        self._tau2_task = tau2_task(task.id)

    def check_turn(self, turn_index: int, env: Any, executed: Executed) -> TurnCheck:
        """Judge the episode so far (all of `env.trajectory`); `executed` only counts this turn's calls."""
        if not isinstance(env, Tau2Environment):
            raise TypeError(f"Tau2Judge needs a Tau2Environment, got {type(env).__name__}")
        if env.domain != self.domain:
            raise ValueError(f"the environment is of domain {env.domain}, the task of {self.domain}")
        evaluators = tau2_module("tau2.evaluator.evaluator_env"), tau2_module("tau2.evaluator.evaluator_action")
        task, trajectory = self._tau2_task, list(env.trajectory)
        details: dict[str, Any] = {"model_calls": len(executed), "episode_calls": len(trajectory) // 2}
        try:
            env_info = evaluators[0].EnvironmentEvaluator.calculate_reward(
                environment_constructor=functools.partial(new_domain_env, self.domain),
                task=task, full_trajectory=trajectory)
        except ValueError as exc:
            # tau2 replays the trajectory and insists every response comes back the same; a tool
            # that draws random ids (telecom's new bills) can break that.
            log.warning("tau2 could not replay the episode of %s: %s", self.task.id, exc)
            details.update(error_type="tau2:replay_mismatch", error=str(exc)[:500])
            return TurnCheck(success=False, state_ok=False, details=details)
        action_info = evaluators[1].ActionEvaluator.calculate_reward(task=task, full_trajectory=trajectory)
        basis = {str(getattr(b, "value", b)) for b in (task.evaluation_criteria.reward_basis
                                                       if task.evaluation_criteria else [])}
        reward = env_info.reward * (action_info.reward if "ACTION" in basis else 1.0)
        db_match = env_info.db_check.db_match if env_info.db_check is not None else True
        assertions = [{"function": a.env_assertion.func_name, "arguments": a.env_assertion.arguments,
                       "expected": a.env_assertion.assert_value, "met": a.met}
                      for a in env_info.env_assertions or []]
        actions = [{"name": c.action.name, "arguments": c.action.arguments, "requestor": str(c.action.requestor),
                    "matched": c.action_match} for c in action_info.action_checks or []]
        details.update(reward=reward, reward_basis=sorted(basis), db_match=db_match,
                       env_assertions=assertions, gold_actions=actions,
                       not_checked=sorted(basis & set(NOT_CHECKED)))
        if not db_match:
            details["error_type"] = "tau2:db_mismatch"
        elif assertions and not all(a["met"] for a in assertions):
            details["error_type"] = "tau2:env_assertion_failed"
        elif reward < 1.0:
            details["error_type"] = "tau2:gold_action_missing"
        return TurnCheck(success=reward == 1.0, state_ok=db_match,
                         response_ok=all(a["met"] for a in assertions), details=details)


def make_judge(task: Task) -> Tau2Judge:
    """A fresh per-episode judge for a tau2 task."""
    return Tau2Judge(task)


def replay_gold(task: Task, env: Tau2Environment | None = None) -> tuple[Tau2Environment, Executed]:
    """Run the task's gold assistant actions on `env` (default: a fresh one); returns it and the calls."""
    env = env if env is not None else Tau2Environment.from_task(task)
    executed: Executed = []
    for action in task.extra["gold_actions"]:
        if action["requestor"] != "assistant":
            continue  # telecom's user actions run on the user's device, which the agent cannot reach
        executed.append((action["name"], action["arguments"], env.call(action["name"], action["arguments"])))
    return env, executed
