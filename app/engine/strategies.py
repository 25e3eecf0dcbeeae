"""The tables the step planner looks up by name: modes, selectors, and the rehearser a setting needs.

`RunSettings.mode` names a function of `modes`, `RunSettings.selector` a `context.Selector`; the
rehearser is passed into the `StepPlanner` (`rehearser_for(settings)` when none is given). The
real best-of-K baseline is therefore configuration: `selector="oracle"` scores by outcome
and needs a rehearser that executes (`ForkRehearser`).
"""
from __future__ import annotations

from typing import Callable

from app.engine import modes
from app.engine.context import Selector, StepContext
from app.engine.oracle import ORACLE, OutcomeSelector
from app.engine.rehearsers import ForkRehearser, ModelRehearser, Rehearser
from app.engine.selection import JudgeSelector, LogprobSelector, MemorySelector
from app.records import RunSettings

MODE_TABLE: dict[str, Callable[[StepContext], int]] = {
    "none": modes.none,
    "parallel": modes.parallel,
    "sequential": modes.sequential,
}
SELECTOR_TABLE: dict[str, Selector] = {
    s.name: s for s in (JudgeSelector(), LogprobSelector(), MemorySelector(), OutcomeSelector())
}


def rehearser_for(settings: RunSettings) -> Rehearser:
    """The rehearser a setting implies: real execution on forks for the oracle, the model otherwise."""
    return ForkRehearser() if settings.selector == ORACLE else ModelRehearser()


def check_settings(settings: RunSettings, rehearser: Rehearser) -> None:
    """Refuse a combination the tables cannot run (ValueError, before any step)."""
    if settings.mode not in MODE_TABLE:
        raise ValueError(f"unknown mode {settings.mode!r}; known: {', '.join(MODE_TABLE)}")
    if settings.selector not in SELECTOR_TABLE:
        raise ValueError(f"unknown selector {settings.selector!r}; known: {', '.join(SELECTOR_TABLE)}")
    if settings.selector == ORACLE and (settings.mode != "parallel" or settings.shadow or not rehearser.executes):
        raise ValueError("selector=oracle (real best-of-K) needs mode=parallel, shadow off and a rehearser "
                         "that executes on forks (see oracle.oracle_settings)")


__all__ = ["MODE_TABLE", "SELECTOR_TABLE", "check_settings", "rehearser_for"]
