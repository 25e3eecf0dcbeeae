"""A recorded environment: an imported trace's tools, answering the calls it recorded with their recorded results.

Nothing runs: a call the trace recorded (same tool, same canonical arguments) gets its real response back, in the
order the trace saw them (the same call made twice answers as the trace's first, then its second); a call the trace
never recorded gets no response, and `ToolResult.missing` says so (the engine then records the branch as not
executed, never as an error the API did not give). It cannot fork: a fork's alternative call would have no recorded
response either, so shadow execution is refused with that reason.
"""
from __future__ import annotations

import copy
from collections import defaultdict, deque
from typing import Any

from app.envs.base import Judge, Task, Tool, ToolResult, ToolTable, TurnCheck
from app.records import TRACE_PREFIX, Call, Episode

RECORDED_CLASS = "RecordedTrace"
NOT_RECORDED = "no recorded response: the trace never made this call"
FORK_REFUSED = ("a recorded trace cannot fork: an alternative call has no recorded response (the trace holds one "
                "real call per step)")


class RecordedEnvironment(ToolTable):
    """The Environment protocol over a trace's recorded (call, response) pairs (tools, `get_tool`, `param_names`,
    `set_turn`: `ToolTable`)."""

    forkable = False

    def __init__(self, tools: list[Tool], recorded: list[tuple[Call, Any, bool]]) -> None:
        self._tools = {t.name: t for t in tools}
        self._recorded = recorded
        self.turn = 0
        self.fork_refusal = FORK_REFUSED
        """Why no call runs on a fork (the engine's card says it for every alternative)."""
        from app.formats import canonical_call  # app.formats imports app.envs.base: not at import time

        self._key = canonical_call
        self._answers: dict[str, deque[tuple[Any, bool]]] = defaultdict(deque)
        for call, response, error in recorded:
            self._answers[canonical_call(call)].append((response, error))
        self.calls: list[Call] = []

    @classmethod
    def from_task(cls, task: Task) -> RecordedEnvironment:
        cfg = task.initial_config.get(RECORDED_CLASS, {})
        tools = [Tool(t["name"], t.get("description", ""), t.get("parameters") or {"type": "object"},
                      env_class=RECORDED_CLASS) for t in cfg.get("tools", [])]
        recorded = [(Call.model_validate(c), r, e) for c, r, e in cfg.get("recorded", [])]
        return cls(tools, recorded)

    def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        call = Call(name=name, arguments=args if isinstance(args, dict) else {})
        self.calls.append(call)
        answers = self._answers.get(self._key(call))
        if not isinstance(args, dict) or not answers:
            return ToolResult(None, error=False, missing=NOT_RECORDED)
        response, error = answers.popleft()
        return ToolResult(copy.deepcopy(response), error=error)

    def fork(self) -> RecordedEnvironment:
        raise RuntimeError(FORK_REFUSED)

    def state(self) -> dict[str, Any]:
        """What can be said of the state: the calls made so far (the real API's state was never recorded)."""
        return {RECORDED_CLASS: {"calls": len(self.calls)}}


class RecordedJudge(Judge):
    """An imported trace has no ground truth: its turns are recorded, never judged."""

    judges_whole_episode = True

    def __init__(self, task: Task) -> None:
        self.task = task

    def check_turn(self, turn_index: int, env: Any, executed: list) -> TurnCheck:
        return TurnCheck(success=False, details={"judged": False, "model_calls": len(executed)})


def recorded_task(episode: Episode) -> Task:
    """The task of an imported episode: its user turns, its tools, and its recorded calls with their responses."""
    src = episode.trace
    if src is None or not episode.task_id.startswith(TRACE_PREFIX):
        raise ValueError(f"episode {episode.id} is not an imported trace")
    recorded = []
    for step in episode.steps:
        b = step.chosen_branch
        if b.kind == "call" and b.call is not None and b.actual_source is not None:
            recorded.append((b.call.model_dump(), b.actual, bool(b.actual_error)))
    steps_per_turn = max([sum(1 for s in episode.steps if s.turn == t) for t in range(len(src.turns) or 1)] + [1])
    return Task(id=episode.task_id, category="trace", turns=[list(t) for t in src.turns] or [[]],
                env_classes=[RECORDED_CLASS],
                initial_config={RECORDED_CLASS: {"tools": [t.model_dump() for t in src.tools], "recorded": recorded}},
                max_steps_per_turn=max(steps_per_turn, 8),
                extra={"system": src.system, "missing": list(src.missing)})


__all__ = ["FORK_REFUSED", "NOT_RECORDED", "RECORDED_CLASS", "RecordedEnvironment", "RecordedJudge", "recorded_task"]
