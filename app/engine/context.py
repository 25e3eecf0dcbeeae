"""One step's scratch state, handed to the mode, the rehearser and the selector of that step.

Whoever plans a step builds a `StepContext` at the start of the decision and drops it at the end (the
`EpisodeRunner` for a step of an episode, through `StepPlanner.context`; the world model and the offline
rehearsal of a recorded trace for a step outside any episode), so nothing a step computes (prompts, forks,
the dedup table) outlives it.

Strategies plan through `planner` (the step's `planner.StepPlanner`: `generate`, `parse_branches`,
`rehearse`, `key_of`, `recall`, its policy, settings and selector), so counting and dedup have one owner,
on `history`, the conversation the step plans on. A strategy that needs the episode itself (the outcome
selector: the judge and the turn's ground truth; the fork rehearser: the environment to fork) reads
`episode`, which is None outside an episode (`require_episode` refuses then).

This module imports neither the planner nor the runner: `Planner` and `Selector` declare what the
strategies use of them, so no module of the engine imports one that imports it back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from app.envs.base import Environment, Judge, Task, Tool
from app.formats import HistoryItem
from app.records import Branch, Call, MemoryHit, RunSettings
from model_backend.base import Generation, Policy, Prompt


class Selector(Protocol):
    name: str
    """The `RunSettings.selector` value that picks it."""
    score_key: str
    """The `Branch.scores` entry its ranking reads (the memory selector ranks by `logprob`)."""

    def score(self, ctx: StepContext, branches: list[Branch]) -> None:
        """Write `scores[score_key]` on each branch (its rehearsal already done)."""
        ...

    def choose(self, ctx: StepContext, branches: list[Branch]) -> int:
        """The index of the branch to commit."""
        ...


class Planner(Protocol):
    """What a step's strategies use of the `planner.StepPlanner` that plans it."""

    policy: Policy
    settings: RunSettings
    selector: Selector

    def generate(self, ctx: StepContext, k: int, *, memory: list[tuple[Any, Any]] | None = None,
                 attempt: int = 0) -> list[Generation]: ...

    def parse_branches(self, ctx: StepContext, generations: list[Generation]) -> list[Branch]: ...

    def rehearse(self, ctx: StepContext, branches: list[Branch]) -> None: ...

    def key_of(self, generation: Generation) -> str: ...

    def recall(self, call: Call) -> list[MemoryHit]: ...


@dataclass(frozen=True)
class EpisodeView:
    """The episode a step is part of, as the strategies that need more than the conversation read it. The
    `EpisodeRunner` fills one for each step; a step planned outside any episode has none."""

    task: Task
    env: Environment
    """The episode's environment in its pre-step state (forks start here; never called by a strategy)."""
    judge: Judge
    """The episode's judge (`check_turn`); a strategy checks a copy (checks replay gold)."""
    turn: int
    """The open user turn."""
    turn_executed: list[tuple[str, dict[str, Any], Any]]
    """(name, arguments, output) of the calls committed in the open turn."""


@dataclass
class StepContext:
    planner: Planner
    index: int
    """The step's index in the episode (seeds derive from it)."""
    tools_list: list[Tool]
    """The tools the agent may call at this step, in the order the prompt lists them."""
    state_before: dict[str, Any]
    """The environment's state when the step began (rehearsal context, forks start here)."""
    history: list[HistoryItem]
    """The conversation the step plans on (Act and Rehearse prompts, the judge selector's request)."""
    episode: EpisodeView | None = None
    """The episode the step is part of; None outside one (the world model, an offline rehearsal)."""
    branches: list[Branch] = field(default_factory=list)
    """Every branch of the step, by index."""
    seen: dict[str, Branch] = field(default_factory=dict)
    """Dedup table: `formats.branch_key` -> the first branch with that key."""
    rehearsals: int = 0
    """Predicted responses the step made (a fork-executing rehearser makes none)."""
    rehearse_prompts: dict[int, Prompt] = field(default_factory=dict)
    """Branch index -> the Rehearse prompt, kept to score the actual response under it (surprise)."""
    predicted_valid: dict[int, bool] = field(default_factory=dict)
    """Branch index -> whether the predicted response parsed."""
    forks: dict[int, Environment] = field(default_factory=dict)
    """Branch index -> the fork a fork-executing rehearser ran the call on."""
    tool_log_p: dict[str, float] = field(default_factory=dict)
    """Tool name -> its log-probability under the step's tool ranking minus the top tool's (`proposals`),
    when tools were ranked with a relevance weight; empty otherwise."""

    tools: dict[str, Tool] = field(init=False)
    """`tools_list` by name."""

    def __post_init__(self) -> None:
        self.tools = {t.name: t for t in self.tools_list}

    def require_episode(self, who: str) -> EpisodeView:
        """The step's episode; ValueError naming `who` needs it when the step is planned outside one."""
        if self.episode is None:
            raise ValueError(f"{who} needs an episode (its environment, judge and task): a step planned outside "
                             "one (the world model, an offline rehearsal) cannot use it")
        return self.episode


__all__ = ["EpisodeView", "Planner", "Selector", "StepContext"]
