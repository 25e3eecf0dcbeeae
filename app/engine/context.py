"""One step's scratch state, handed to the mode, the rehearser and the selector of that step.

The runner builds a `StepContext` at the start of every decision and drops it at the end,
so nothing a step computes (prompts, forks, the dedup table) outlives it on the runner.
Strategies reach the episode through `runner` (its policy, settings, env, history) and
propose or rehearse through the runner's `propose` and `rehearse`, so counting and
dedup have one owner.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.envs.base import Environment, Tool
from app.records import Branch
from model_backend.base import Prompt

if TYPE_CHECKING:
    from app.engine.runner import EpisodeRunner


@dataclass
class StepContext:
    runner: "EpisodeRunner"
    index: int
    """The step's index in the episode (seeds derive from it)."""
    tools_list: list[Tool]
    """The tools the agent may call at this step, in the order the prompt lists them."""
    state_before: dict[str, Any]
    """The environment's state when the step began (rehearsal context, forks start here)."""
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


__all__ = ["StepContext"]
