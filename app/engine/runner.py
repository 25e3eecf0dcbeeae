"""The episode loop: for each user turn, steps until the agent answers or the budget ends.

A step: the `StepPlanner` plans the decision (Act proposes K candidates -> each call is rehearsed,
one batched pass -> the selector scores them and picks one) -> every non-chosen call runs on its
own fork of the pre-step state (shadow execution, inspection only; read-only calls only where the
environment cannot fork) -> the chosen one is committed to the real environment -> the planner
measures divergence for every branch that has both a prediction and an actual response.

The runner owns the episode: its turns (scripted and typed), resume, computing the next step ahead,
shadow execution, the commit, the judge, the counts and what the memory observes. What a decision
needs from the model (prompts, seeds, proposals, dedup, rehearsal, selection, the relevance cache)
is the planner's (`planner.py`), which the runner builds and hands each step's `StepContext` with
the conversation so far and a view of the episode (`EpisodeView`, for the outcome selector).
A step's scratch state lives in its `StepContext`, never on the runner.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
import uuid
from typing import Any, Callable, Iterator

from app import envs
from app.engine.context import EpisodeView
from app.engine.history import TYPED_USER_MESSAGE, committed_messages, turn_messages, with_typed_turns
from app.engine.memory import MemoryScope, RehearsalMemory, observed
from app.engine.planner import StepPlanner
from app.engine.rehearsers import Rehearser
from app.envs.base import Environment, Judge, Task, Tool
from app.formats import HistoryItem, canonical_json
from app.records import Branch, EndReason, Episode, RunSettings, Step, TurnEnd, TurnResult, utcnow
from model_backend.base import AheadStopped, Policy, Timings

log = logging.getLogger(__name__)

StepCallback = Callable[[Episode, Step], None]
NOT_EXECUTED_SHADOW_OFF = "shadow execution off"
NOT_EXECUTED_CANNOT_FORK = ("the tool is not marked read-only, and this environment's forks share its real backend "
                            "(e.g. a remote MCP server), so only read-only calls run on them")


class EpisodeRunner:
    """Runs one episode step by step; `step()` is what the UI's Step button calls."""

    def __init__(self, task: Task, policy: Policy, settings: RunSettings, *,
                 model: str | None = None, adapter: str | None = None,
                 on_step: StepCallback | None = None, env: Environment | None = None,
                 judge: Judge | None = None, episode_id: str | None = None, rehearser: Rehearser | None = None,
                 memory: RehearsalMemory | None = None, exclude_own_task: bool = False) -> None:
        self.task = task
        episode_id = episode_id or uuid.uuid4().hex[:12]
        # Evaluation (`exclude_own_task`): never retrieve this task's transitions from other episodes.
        self.planner = StepPlanner(policy, settings, rehearser=rehearser, memory=memory,
                                   scope=MemoryScope(settings.memory, task.id, episode_id, exclude_own_task))
        """Plans each decision (propose, rehearse, select); the runner executes, commits and judges it."""
        self.env = env if env is not None else envs.make_env(task)
        self.judge = judge if judge is not None else envs.make_judge(task)
        self.on_step = on_step
        self.episode = Episode(id=episode_id, task_id=task.id, model=model or policy.name, adapter=adapter,
                               settings=self.settings)
        self.history: list[HistoryItem] = []
        self.timings = Timings()
        """Seconds in tool execution per phase (`shadow`, `commit`); the model's own phases are the policy's."""
        self.turn = 0
        self._turn_open = False
        self._turn_steps = 0
        self.turn_executed: list[tuple[str, dict[str, Any], Any]] = []
        """(name, arguments, output) of the calls committed in the open turn, for the judge."""
        self.resume_mismatches: list[int] = []
        """Steps whose response differed when `resume` executed them again."""
        self.typed_turns: dict[int, str] = {}
        """User turns a person typed (`add_user_turn`), by turn index."""
        self.memory = memory
        """Real transitions the Rehearse prompts retrieve from (the planner's, `settings.memory` says which); every
        real response this episode observes is added to it. None: no retrieval, nothing remembered."""
        self._ahead_s = 0.0
        self._ahead_for: tuple[int, str] | None = None
        """Seconds `compute_ahead` spent on the next step, and which step: (its index, the task's turns then); a
        typed user turn in between makes that work another step's (`_ahead_seconds`)."""

    @classmethod
    def resume(cls, episode: Episode, task: Task, policy: Policy, *, on_step: StepCallback | None = None,
               env: Environment | None = None, judge: Judge | None = None,
               rehearser: Rehearser | None = None, memory: RehearsalMemory | None = None) -> EpisodeRunner:
        """Continue a recorded episode (an interrupted or stopped one) where it ended.

        A fresh environment gets the committed calls again, in order (the tools are deterministic
        given the same calls), the history is rebuilt by the same rule as live, and turns the
        episode already judged keep their verdicts. `resume_mismatches` lists steps whose re-executed
        response differs from the recorded one (a tool that is not deterministic).
        """
        runner = cls(task, policy, episode.settings, model=episode.model, adapter=episode.adapter,
                     on_step=on_step, env=env, judge=judge, episode_id=episode.id,
                     rehearser=rehearser, memory=memory)
        runner.episode = episode.model_copy(update={"status": "running", "finished_at": None, "error": None,
                                                    "end_reason": None})
        runner.resume_mismatches = []
        turns, typed = with_typed_turns(task.turns, episode.turn_results)
        if typed:  # the turns a person typed come back from the verdicts that recorded them
            runner.task, runner.typed_turns = dataclasses.replace(task, turns=turns), typed
        judged = {t.turn for t in episode.turn_results}
        steps = episode.steps
        for i, step in enumerate(steps):
            if not runner._turn_open:
                runner.turn = step.turn
                runner._open_turn()
            branch = step.chosen_branch
            if branch.kind == "call" and branch.call is not None:
                result = runner.env.call(branch.call.name, branch.call.arguments)
                runner.turn_executed.append((branch.call.name, branch.call.arguments, result.output))
                if canonical_json(result.output) != canonical_json(branch.actual):
                    runner.resume_mismatches.append(step.index)
            runner.history += committed_messages(branch, step.turn)
            runner._turn_steps += 1
            last_of_turn = i == len(steps) - 1 or steps[i + 1].turn != step.turn
            if last_of_turn and step.turn in judged:
                # Judged again (same calls, same state) only to advance the judge's own gold replay;
                # the recorded verdict stays.
                runner.judge.check_turn(step.turn, runner.env, runner.turn_executed)
                runner._turn_open = False
                runner.turn = step.turn + 1
        return runner

    # ------------------------------------------------------------ public loop

    @property
    def policy(self) -> Policy:
        return self.planner.policy

    @property
    def settings(self) -> RunSettings:
        """The episode's settings (tool relevance off where the policy cannot score: `StepPlanner`)."""
        return self.planner.settings

    @property
    def done(self) -> bool:
        return self.episode.status != "running"

    @property
    def budget(self) -> int:
        return self.settings.max_steps_per_turn or self.task.max_steps_per_turn

    def step(self) -> Step | None:
        """Take one agent decision (opening the next user turn if needed)."""
        if self.done:
            return None
        if not self._turn_open and self.turn >= len(self.task.turns):
            # Nothing left to answer: a continued episode whose typed turn was never answered (only
            # judged turns keep their typed message). `add_user_turn` opens a new one.
            self._finish("no_turn_left")
            return None
        if not self._turn_open:
            self._open_turn()
        started = time.perf_counter()
        state_before = self.env.state()
        step = self._decide(state_before)
        step.duration_s = round(time.perf_counter() - started, 3)
        step.ahead_s = round(self._ahead_seconds(step.index), 3)
        self._remember(step)
        self._count(step)
        self.episode.steps.append(step)
        self._turn_steps += 1
        if step.kind == "answer":
            self._close_turn("answer")
        elif self._turn_steps >= self.budget:
            self._close_turn("step_budget")
        if self.on_step is not None:
            self.on_step(self.episode, step)
        return step

    def run_turn(self) -> Iterator[Step]:
        turn = self.turn
        while not self.done and self.turn == turn:
            step = self.step()
            if step is not None:
                yield step

    def run(self) -> Iterator[Step]:
        while not self.done:
            step = self.step()
            if step is not None:
                yield step

    def run_all(self) -> Episode:
        for _ in self.run():
            pass
        return self.episode

    def add_user_turn(self, text: str) -> int:
        """A person speaks as the user: `text` is the next user turn, instead of the scripted one when
        one is left, else after the last (then a finished episode runs again). Returns the turn's index.

        Only between turns (the agent has answered, or the turn's budget ended). After the scripted
        turns only where the judge judges the whole episode (`judges_whole_episode`, e.g. tau2): a
        per-turn judge (BFCL) has no ground truth for a turn the task does not have. `self.task` is
        replaced by a copy with the new turns; the caller's Task is never changed.
        """
        text = (text or "").strip()
        if not text:
            raise ValueError("The user message is empty: type what the user says.")
        if self.episode.status in ("stopped", "failed"):
            raise ValueError(f"Episode {self.episode.id} is {self.episode.status}: start a new one to speak as the user.")
        if self._turn_open:
            raise ValueError("The agent has not answered this turn yet: step until it answers (or the turn's "
                             "step budget ends), then speak as the user.")
        turns = [list(t) for t in self.task.turns]
        message = [{"role": "user", "content": text}]
        if self.turn < len(turns):
            turns[self.turn] = message
        elif self.judge.judges_whole_episode:
            turns.append(message)
        else:
            raise ValueError(f"Task {self.task.id} has {len(turns)} scripted turn(s), each judged against its own "
                             "ground truth: a further user turn cannot be judged (type instead of a scripted turn).")
        self.task = dataclasses.replace(self.task, turns=turns)
        self.typed_turns[self.turn] = text
        if self.episode.status == "finished":
            self.episode.status, self.episode.finished_at, self.episode.success = "running", None, None
            self.episode.end_reason = None
        return self.turn

    def compute_ahead(self, cancel: threading.Event | None = None) -> bool:
        """Compute the next step ahead of time, while a person reads the last one, so that `step()` then only
        commits: its model calls run now on a scratch copy of the runner (the environment forked, the history
        and the turn's calls copied, the next user turn opened on the copy where the last one closed; its planner
        a copy planning with the bare policy, whose new relevance scores the runner's planner keeps), and the
        policy keeps their results for the step that makes the same calls (`computing_ahead`; scores are kept
        anyway). Nothing of the episode changes. Where `cancel` is set, it stops before its next model call
        (the one running finishes, and is kept), as it does while a step of another session waits for the
        model. True when the whole step was computed; False where it was
        cancelled or cannot pay: an episode that is over, an environment that cannot fork in memory (its
        forks would reach a real backend), or a policy that keeps no results (a remote server, weights in
        training)."""
        inner = self.policy.inner  # the UI's progress wrapper reports the real step only
        if self.done or not self.env.forkable or not inner.can_compute_ahead:
            return False
        if not self._turn_open and self.turn >= len(self.task.turns):
            return False
        scratch = copy.copy(self)
        scratch.planner = self.planner.scratch(inner)
        scratch.env = self.env.fork()
        scratch.history, scratch.turn_executed = list(self.history), list(self.turn_executed)
        scratch.timings, scratch.on_step = Timings(), None
        stop = (cancel or threading.Event()).is_set
        target = self._ahead_target()
        started = time.perf_counter()
        try:
            with inner.computing_ahead(stop):
                if not scratch._turn_open:
                    scratch._open_turn()
                scratch._decide(scratch.env.state())
        except AheadStopped:
            return False
        finally:
            # Stopped or not, what it computed is kept for the step (the model call running when it stopped too).
            if self._ahead_for != target:
                self._ahead_for, self._ahead_s = target, 0.0
            self._ahead_s += time.perf_counter() - started
            scratch.env.close()
        self.planner.keep_relevance(scratch.planner)
        return True

    def _ahead_target(self) -> tuple[int, str]:
        return len(self.episode.steps), canonical_json(self.task.turns)

    def _ahead_seconds(self, index: int) -> float:
        """The seconds `compute_ahead` spent on step `index` (0 when none, or when the turns changed since), and
        start again."""
        seconds = self._ahead_s if self._ahead_for == (index, canonical_json(self.task.turns)) else 0.0
        self._ahead_for, self._ahead_s = None, 0.0
        return seconds

    def stop(self) -> None:
        """End the episode before its end (Stop, Reset, a changed task or settings, a run's turn limit)."""
        if not self.done:
            self.episode.status, self.episode.end_reason = "stopped", "stopped"
            self.episode.finished_at = utcnow()

    def fail(self, error: str) -> None:
        """End the episode on a failed step (its complete steps stay): `error` says what failed."""
        self.episode.status, self.episode.end_reason, self.episode.error = "failed", "failed", error[:500]
        self.episode.finished_at = utcnow()

    # ------------------------------------------------------------ turns

    def _open_turn(self) -> None:
        self.env.set_turn(self.turn)  # miss_func: tools that appear at this turn
        self.history += turn_messages(self.task, self.turn)
        self._turn_open, self._turn_steps, self.turn_executed = True, 0, []

    def _close_turn(self, ended_by: TurnEnd) -> None:
        check = self.judge.check_turn(self.turn, self.env, self.turn_executed)
        details = dict(check.details)
        if self.turn in self.typed_turns:
            details[TYPED_USER_MESSAGE] = self.typed_turns[self.turn]
        self.episode.turn_results.append(TurnResult(
            turn=self.turn, success=check.success, state_ok=check.state_ok,
            response_ok=check.response_ok, steps=self._turn_steps, ended_by=ended_by, details=details))
        self._turn_open = False
        self.turn += 1
        if self.turn >= len(self.task.turns):
            self._finish("answered" if ended_by == "answer" else "step_budget")

    def _finish(self, reason: EndReason) -> None:
        self.episode.status, self.episode.end_reason = "finished", reason
        results = self.episode.turn_results
        # A whole-episode judge's last verdict covers every turn before it.
        whole = self.judge.judges_whole_episode
        if whole:
            self.episode.success = results[-1].success if results else None
        else:
            self.episode.success = all(t.success for t in results)
        self.episode.finished_at = utcnow()

    def _remember(self, step: Step) -> None:
        """Every real response of the step (committed, shadow) joins the memory, whatever `settings.memory`:
        what is observed is kept; the setting decides what is retrieved."""
        if self.memory is not None:
            self.memory.add(observed(step, task_id=self.task.id, split=self.task.extra.get("split"),
                                     episode_id=self.episode.id, tools={t.name: t for t in self.env.tools()}))

    def _count(self, step: Step) -> None:
        self.episode.external_calls += step.external_calls
        self.episode.shadow_calls += step.shadow_calls
        self.episode.rehearsals += step.rehearsals

    # ------------------------------------------------------------ one decision

    def _decide(self, state_before: dict[str, Any]) -> Step:
        view = EpisodeView(task=self.task, env=self.env, judge=self.judge, turn=self.turn,
                           turn_executed=self.turn_executed)
        ctx = self.planner.context(len(self.episode.steps), self.env.tools(), self.history, state_before, view)
        chosen = self.planner.plan(ctx)
        branches = ctx.branches
        branches[chosen].chosen = True
        with self.timings.phase("shadow"):
            shadow_calls = self._shadow(branches, chosen, ctx.tools)
        with self.timings.phase("commit"):
            external = self._commit(branches[chosen])
        if self.planner.rehearser.executes:  # its fork executions were the agent's own calls; the chosen one counts once
            external += len(ctx.forks) - (1 if chosen in ctx.forks else 0)
        for fork in ctx.forks.values():  # an MCP fork holds a server process: end it with the step
            fork.close()
        self.planner.measure(ctx)
        return Step(index=ctx.index, turn=self.turn, branches=branches, chosen=chosen,
                    kind=branches[chosen].kind, state_before=state_before,
                    state_after=self.env.state(), rehearsals=ctx.rehearsals,
                    shadow_calls=shadow_calls, external_calls=external)

    # ------------------------------------------------------------ execution

    def _shadow(self, branches: list[Branch], chosen: int, tools: dict[str, Tool]) -> int:
        """Run each non-chosen call on its own fork of the pre-step state (inspection only).

        Runs before the commit, so a fork is the state the agent decided in. Writes run too
        where the environment forks in memory (`forkable`); elsewhere only read-only tools.
        The episode's environment is never called. Returns the shadow calls made.
        """
        forkable = self.env.forkable
        count = 0
        for b in branches:
            if b.index == chosen or b.kind != "call" or b.actual_source is not None:
                continue
            tool = tools.get(b.call.name)
            if not self.settings.shadow:
                b.not_executed = NOT_EXECUTED_SHADOW_OFF
                continue
            if not forkable and (tool is None or not tool.read_only):
                b.not_executed = self.env.fork_refusal or NOT_EXECUTED_CANNOT_FORK
                continue
            fork = self.env.fork()
            result = fork.call(b.call.name, b.call.arguments)
            b.actual, b.actual_error, b.actual_source = result.output, result.error, "shadow"
            b.shadow_state_after = fork.state()
            fork.close()  # an MCP fork holds a server process: end it now, not at garbage collection
            count += 1
        return count

    def _commit(self, branch: Branch) -> int:
        """Execute the chosen action for real and extend the conversation; returns external calls."""
        external = 0
        if branch.kind == "parse_error":
            # The agent sees why its action failed, as a tool-calling API would answer it.
            error = {"error": f"could not parse the tool call: {branch.parse_error}"}
            branch.actual, branch.actual_error, branch.actual_source = error, True, "committed"
        elif branch.kind == "call":
            on_fork = canonical_json(branch.actual) if branch.actual_source == "shadow" else None
            result = self.env.call(branch.call.name, branch.call.arguments)
            if result.missing:  # a recorded environment without this call: no response, never a made-up one
                branch.actual, branch.actual_error, branch.not_executed = None, None, result.missing
            else:
                branch.actual, branch.actual_error, branch.actual_source = result.output, result.error, "committed"
                external = 1
            self.turn_executed.append((branch.call.name, branch.call.arguments, result.output))
            if on_fork is not None:  # run on its fork first (a fork-executing rehearser)
                branch.shadow_state_after = None  # the step's own state_after shows its effect now
                if canonical_json(result.output) != on_fork:
                    log.warning("%s: %s returned differently on its fork and for real",
                                self.task.id, branch.call.name)
        self.history += committed_messages(branch, self.turn)
        return external


__all__ = ["EpisodeRunner", "NOT_EXECUTED_CANNOT_FORK", "NOT_EXECUTED_SHADOW_OFF"]
