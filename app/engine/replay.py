"""Replays: a task's ground truth executed call by call in a real environment, and a recorded episode's steps
with the history the agent had at each.

- `ground_truth_calls`: the task's ground-truth calls parsed, turn by turn (nothing runs).
- `replay_ground_truth`: one turn of them executed in order on an environment, each yielded with its context
  (`GoldCall`: the tools at the call, the state before and after, the call, the real result). Training's expert
  episodes (`training.rows.expert_episode`) and the rehearsal memory's seed (`training.memory_seed`) are made
  by it.
- `replay`: a recorded `Episode` walked step by step, the runner's history rebuilt before each step by the
  runner's own rule (`history.turn_messages`, `history.committed_messages`; nothing is executed). Training rows,
  the eval's state probe and the offline rehearsal of stored episodes read recorded episodes through it, and
  its `StepView.rehearse_prompt` is the live rehearser's prompt (`history.rehearse_step_prompt`).

An expert episode's history is `replay` of the episode `replay_ground_truth` ran (the turn's closing answer is the
episode's, not the ground truth's), so there is one history rule for live runs and recorded ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from app import envs
from app.engine.history import committed_messages, rehearse_step_prompt, turn_messages
from app.envs.base import Environment, Task, Tool, ToolResult
from app.formats import HistoryItem, in_schema_order
from app.records import Call, Episode, MemoryHit, Step
from model_backend.base import Prompt


def tool_named(tools: Sequence[Tool], name: str) -> Tool | None:
    """The tool of that name (the last listed, as a by-name table keeps it), or None."""
    return {t.name: t for t in tools}.get(name)


def ground_truth_calls(task: Task, env: Environment) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(turn, tool name, arguments as the ground truth writes them) of every ground-truth call, in order;
    positional arguments are named by `env`'s parameter lists. Nothing is executed."""
    for turn, calls in enumerate(task.ground_truth or []):
        for call_string in calls:
            name, args = envs.parse_call_string(call_string, env.param_names)
            yield turn, name, args


@dataclass
class GoldCall:
    """One ground-truth call of a replay, with what surrounded it."""

    turn: int
    tools: list[Tool]
    """The tools available at the call."""
    name: str
    arguments: dict[str, Any]
    """As the ground truth writes them: what the environment is called with."""
    call: Call
    """The same call, its arguments in the tool's schema order (the order the constrained Act writes)."""
    state_before: Any = None
    """The environment's state before the call (`replay_ground_truth(states=True)`; None otherwise)."""
    result: ToolResult | None = None
    """The real result, once executed (None when `before` sees the call)."""
    state_after: Any = None

    @property
    def tool(self) -> Tool | None:
        return tool_named(self.tools, self.name)


def replay_ground_truth(task: Task, env: Environment, turn: int, *, states: bool = False,
                        before: Callable[[GoldCall], None] | None = None) -> Iterator[GoldCall]:
    """Enter `turn` on `env` and execute the turn's ground-truth calls in order, yielding each once its real
    result is in. `states`: also read the state before and after each call. `before` sees each call before it
    runs (`result` still None; the memory seed explores forks of that state)."""
    env.set_turn(turn)
    truth = task.ground_truth or []
    for call_string in truth[turn] if turn < len(truth) else []:
        name, args = envs.parse_call_string(call_string, env.param_names)
        tools = env.tools()
        gold = GoldCall(turn=turn, tools=tools, name=name, arguments=args,
                        call=Call(name=name, arguments=in_schema_order(args, tool_named(tools, name))),
                        state_before=env.state() if states else None)
        if before is not None:
            before(gold)
        gold.result = env.call(name, args)
        if states:
            gold.state_after = env.state()
        yield gold


@dataclass
class StepView:
    """One step of a replayed episode, with the context the agent had when it decided."""

    step: Step
    history: list[HistoryItem]
    """The conversation before the step (a copy)."""
    tools: list[Tool]
    """The tools available at the step."""

    def rehearse_prompt(self, call: Call, rehearsal_context: str = "history", constrain: bool = False,
                        examples: Sequence[MemoryHit] = ()) -> Prompt:
        """The Rehearse prompt of `call` at this step, as the live rehearser builds it; `examples`: retrieved
        real transitions."""
        return rehearse_step_prompt(tool_named(self.tools, call.name), call, self.history, self.step.state_before,
                                    rehearsal_context, constrain=constrain, examples=examples)


def replay(episode: Episode, task: Task, env: Environment | None = None) -> Iterator[StepView]:
    """Walk an episode's steps, rebuilding the runner's history before each one. `env`: a fresh environment of
    `task` when `envs.make_env` cannot make one (a typed instruction's); only its tool list per turn is read."""
    env = env if env is not None else envs.make_env(task)  # nothing is executed
    history: list[HistoryItem] = []
    turn = -1
    for step in episode.steps:
        while turn < step.turn:
            turn += 1
            env.set_turn(turn)
            history += turn_messages(task, turn)
        yield StepView(step, list(history), env.tools())
        history += committed_messages(step.chosen_branch, step.turn)


__all__ = ["GoldCall", "StepView", "ground_truth_calls", "replay", "replay_ground_truth", "tool_named"]
