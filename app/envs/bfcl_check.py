"""BFCL's per-turn success check: gold replay, then state and response comparison.

Mirrors `bfcl_eval/eval_checker/multi_turn_eval/multi_turn_checker.py`: after each turn
the public attributes of every instance must equal those of a gold environment that
replayed all gold calls so far, and every gold result of the turn must appear (as a
multiset, order free) among the results of the model's calls so far. A turn without
gold calls (miss_func, miss_param) passes only when the model made no call.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import (
    _compare_instances,
    _is_subsequence_unordered,
)

from app.envs.base import Executed, Judge, Task, ToolResult, TurnCheck
from app.envs.bfcl import BFCLEnvironment, to_jsonable
from app.envs.bfcl_tasks import parse_call_string

log = logging.getLogger(__name__)

"""The calls the model's environment executed in one turn: (name, args, ToolResult or output)."""


class _GoldEnv(Protocol):
    def call(self, name: str, args: dict[str, Any]) -> ToolResult: ...
    def param_names(self, tool_name: str) -> list[str]: ...
    def set_turn(self, turn: int) -> None: ...


def canonical_result(result: Any) -> str:
    """One call's result as canonical JSON, the unit of the response check."""
    output = result.output if isinstance(result, ToolResult) else result
    return json.dumps(to_jsonable(output), sort_keys=True, ensure_ascii=False)


class ReplayJudge(Judge):
    """Checks turns in order against its own gold environment; subclasses compare state."""

    def __init__(self, task: Task, gold_env: _GoldEnv) -> None:
        if task.ground_truth is None:
            raise ValueError(f"task {task.id} has no ground truth")
        self.task = task
        self._gold_env = gold_env
        self._next_turn = 0
        # BFCL matches a turn's gold results against the model's results of *all* turns
        # so far: a model may have fetched something already in an earlier turn.
        self._model_results: list[str] = []

    def state_differences(self, env: Any) -> dict[str, Any]:
        """Differences between `env` and the gold environment; empty when they match."""
        raise NotImplementedError

    def check_turn(self, turn_index: int, env: Any, executed: Executed) -> TurnCheck:
        """Replay gold turn `turn_index` and judge the model's `env` and `executed` calls."""
        if turn_index != self._next_turn:
            raise ValueError(f"turns must be checked in order: expected {self._next_turn}, got {turn_index}")
        self._next_turn += 1
        gold_calls = self.task.ground_truth[turn_index]  # type: ignore[index]
        gold_results = self._replay(turn_index, gold_calls)
        self._model_results.extend(canonical_result(r) for _, _, r in executed)
        details: dict[str, Any] = {"gold_calls": list(gold_calls), "model_calls": len(executed)}

        if not gold_calls:
            # BFCL's irrelevance check: the model should not act when it cannot.
            success = not executed
            if not success:
                details["error_type"] = "multi_turn:irrelevance_error"
            return TurnCheck(success=success, details=details)

        differences = self.state_differences(env)
        _, missing = _is_subsequence_unordered(gold_results, self._model_results)
        state_ok, response_ok = not differences, not missing
        if not executed:
            details["error_type"] = "multi_turn:empty_turn_model_response"
        elif not state_ok:
            details["error_type"] = "multi_turn:instance_state_mismatch"
        elif not response_ok:
            details["error_type"] = "multi_turn:execution_response_mismatch"
        if differences:
            details["state_differences"] = differences
        if missing:
            details["missing_results"] = [json.loads(m) for m in missing]
        return TurnCheck(
            success=bool(executed) and state_ok and response_ok,
            state_ok=state_ok,
            response_ok=response_ok,
            details=details,
        )

    def _replay(self, turn_index: int, gold_calls: list[str]) -> list[str]:
        self._gold_env.set_turn(turn_index)
        results = []
        for call in gold_calls:
            name, args = parse_call_string(call, self._gold_env.param_names)
            result = self._gold_env.call(name, args)
            if result.error:
                log.debug("gold call %s of %s returned an error: %s", call, self.task.id, result.output)
            results.append(canonical_result(result))
        return results


class BFCLJudge(ReplayJudge):
    """BFCL's state and response checks for one task (one judge per episode)."""

    def __init__(self, task: Task) -> None:
        # The gold replay sees every tool: one gold call (miss_func_49's `tail`) uses a
        # tool before the turn that reveals it, and BFCL's executor would run it.
        super().__init__(task, BFCLEnvironment.from_task(task, all_tools=True))

    def state_differences(self, env: Any) -> dict[str, Any]:
        if not isinstance(env, BFCLEnvironment):
            raise TypeError(f"BFCLJudge needs a BFCLEnvironment, got {type(env).__name__}")
        gold: BFCLEnvironment = self._gold_env  # type: ignore[assignment]
        model_instances = env.instances
        differences: dict[str, Any] = {}
        for class_name, gold_instance in gold.instances.items():
            if class_name not in model_instances:
                raise ValueError(f"the model's environment lacks {class_name}")
            valid, diff = _compare_instances(model_instances[class_name], gold_instance)
            if not valid:
                differences[class_name] = to_jsonable(diff)
        return differences


def replay_ground_truth(task: Task) -> list[TurnCheck]:
    """Run the gold calls in a normal environment for `task` and check every turn."""
    env = BFCLEnvironment.from_task(task)
    judge = BFCLJudge(task)
    checks = []
    for turn_index, calls in enumerate(task.ground_truth or []):
        env.set_turn(turn_index)
        executed: Executed = []
        for call in calls:
            name, args = parse_call_string(call, env.param_names)
            executed.append((name, args, env.call(name, args)))
        checks.append(judge.check_turn(turn_index, env, executed))
    return checks
