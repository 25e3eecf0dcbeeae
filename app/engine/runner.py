"""The episode loop: for each user turn, steps until the agent answers or the budget ends.

A step: Act proposes K candidates -> each call is rehearsed (one batched pass) -> the
selector scores them -> every non-chosen call runs on its own fork of the pre-step state
(shadow execution, inspection only; read-only calls only where the environment cannot
fork) -> the chosen one is committed to the real environment -> divergence
metrics for every branch that has both a prediction and an actual response.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, Iterator

from app import envs
from app.divergence import compare, mean_nll
from app.engine import selection
from app.envs.base import Environment, Task, Tool
from app.engine.history import committed_messages, turn_messages
from app.formats import (ACT_STOP, REHEARSE_STOP, TOOL_CALL_OPEN, HistoryItem, act_prompt, branch_key,
                         canonical_json, parse_action, parse_result, rehearse_prompt, rehearse_target)
from app.records import Branch, Episode, RunSettings, Step, TurnResult, utcnow
from model_backend.base import Generation, GenerationConfig, Policy, Prompt, RemoteCapabilityError, Timings

log = logging.getLogger(__name__)

StepCallback = Callable[[Episode, Step], None]
NOT_EXECUTED_SHADOW_OFF = "shadow execution off"
NOT_EXECUTED_CANNOT_FORK = ("the tool is not marked read-only, and this environment's forks share its real backend "
                            "(e.g. a remote MCP server), so only read-only calls run on them")


def step_seed(seed: int, step_index: int, attempt: int = 0) -> int:
    """A distinct, reproducible seed per step (and per sequential attempt)."""
    return (seed * 1_000_003 + step_index * 101 + attempt) % (2**31 - 1)


class EpisodeRunner:
    """Runs one episode step by step; `step()` is what the UI's Step button calls."""

    def __init__(self, task: Task, policy: Policy, settings: RunSettings, *,
                 model: str | None = None, adapter: str | None = None,
                 on_step: StepCallback | None = None, env: Environment | None = None,
                 judge: Any = None, episode_id: str | None = None) -> None:
        self.task, self.policy, self.settings = task, policy, settings
        self.env = env if env is not None else envs.make_env(task)
        self.judge = judge if judge is not None else envs.make_judge(task)
        self.on_step = on_step
        self.episode = Episode(id=episode_id or uuid.uuid4().hex[:12], task_id=task.id,
                               model=model or policy.name, adapter=adapter, settings=settings)
        self.history: list[HistoryItem] = []
        self.timings = Timings()
        """Seconds in tool execution per phase (`shadow`, `commit`); the model's own phases are the policy's."""
        self.turn = 0
        self._turn_open = False
        self._turn_steps = 0
        self._turn_executed: list[tuple[str, dict[str, Any], Any]] = []
        self._rehearse_prompts: dict[int, Prompt] = {}
        self._predicted_valid: dict[int, bool] = {}
        self._state_before: dict[str, Any] = {}
        self.resume_mismatches: list[int] = []
        """Steps whose response differed when `resume` executed them again."""

    @classmethod
    def resume(cls, episode: Episode, task: Task, policy: Policy, *, on_step: StepCallback | None = None,
               env: Environment | None = None, judge: Any = None) -> EpisodeRunner:
        """Continue a recorded episode (an interrupted or stopped one) where it ended.

        A fresh environment gets the committed calls again, in order (the tools are deterministic
        given the same calls), the history is rebuilt by the same rule as live, and turns the
        episode already judged keep their verdicts. `resume_mismatches` lists steps whose re-executed
        response differs from the recorded one (a tool that is not deterministic).
        """
        runner = cls(task, policy, episode.settings, model=episode.model, adapter=episode.adapter,
                     on_step=on_step, env=env, judge=judge, episode_id=episode.id)
        runner.episode = episode.model_copy(update={"status": "running", "finished_at": None, "error": None})
        runner.resume_mismatches = []
        judged = {t.turn for t in episode.turn_results}
        steps = episode.steps
        for i, step in enumerate(steps):
            if not runner._turn_open:
                runner.turn = step.turn
                runner._open_turn()
            branch = step.chosen_branch
            if branch.kind == "call" and branch.call is not None:
                result = runner.env.call(branch.call.name, branch.call.arguments)
                runner._turn_executed.append((branch.call.name, branch.call.arguments, result.output))
                if canonical_json(result.output) != canonical_json(branch.actual):
                    runner.resume_mismatches.append(step.index)
            runner.history += committed_messages(branch, step.turn)
            runner._turn_steps += 1
            last_of_turn = i == len(steps) - 1 or steps[i + 1].turn != step.turn
            if last_of_turn and step.turn in judged:
                # Judged again (same calls, same state) only to advance the judge's own gold replay;
                # the recorded verdict stays.
                runner.judge.check_turn(step.turn, runner.env, runner._turn_executed)
                runner._turn_open = False
                runner.turn = step.turn + 1
        return runner

    # ------------------------------------------------------------ public loop

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
        if not self._turn_open:
            self._open_turn()
        started = time.perf_counter()
        state_before = self.env.state()
        step = self._decide(state_before)
        step.duration_s = round(time.perf_counter() - started, 3)
        self._count(step)
        self.episode.steps.append(step)
        self._turn_steps += 1
        if step.kind == "answer" or self._turn_steps >= self.budget:
            self._close_turn()
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

    def stop(self) -> None:
        if not self.done:
            self.episode.status = "stopped"
            self.episode.finished_at = utcnow()

    # ------------------------------------------------------------ turns

    def _open_turn(self) -> None:
        if hasattr(self.env, "set_turn"):
            self.env.set_turn(self.turn)  # miss_func: tools that appear at this turn
        self.history += turn_messages(self.task, self.turn)
        self._turn_open, self._turn_steps, self._turn_executed = True, 0, []

    def _close_turn(self) -> None:
        check = self.judge.check_turn(self.turn, self.env, self._turn_executed)
        self.episode.turn_results.append(TurnResult(
            turn=self.turn, success=check.success, state_ok=check.state_ok,
            response_ok=check.response_ok, steps=self._turn_steps, details=check.details))
        self._turn_open = False
        self.turn += 1
        if self.turn >= len(self.task.turns):
            self.episode.status = "finished"
            self.episode.success = all(t.success for t in self.episode.turn_results)
            self.episode.finished_at = utcnow()

    def _count(self, step: Step) -> None:
        self.episode.external_calls += step.external_calls
        self.episode.shadow_calls += step.shadow_calls
        self.episode.rehearsals += step.rehearsals

    # ------------------------------------------------------------ one decision

    def _request(self) -> str:
        users = [h.content for h in self.history if h.role == "user"]
        return users[-1] if users else ""

    def _act_prompt(self, tools: list[Tool], memory: list[tuple[Any, Any]] | None = None) -> Prompt:
        prefill = TOOL_CALL_OPEN if self.settings.tool_choice == "required" else ""
        return act_prompt(tools, self.history, self.policy.count_tokens, self.policy.context_window,
                          reserve=self.settings.max_action_tokens + 32, memory=memory, prefill=prefill,
                          constrain=self.settings.constrain)

    def _act_config(self, index: int, attempt: int = 0) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.settings.max_action_tokens,
                                temperature=self.settings.temperature,
                                seed=step_seed(self.settings.seed, index, attempt), stop=ACT_STOP)

    def _branches(self, generations: list[Generation], start: int = 0,
                  seen: dict[str, Branch] | None = None) -> list[Branch]:
        """Parse candidates into branches, folding duplicates (same canonical call) into the first."""
        seen = {} if seen is None else seen
        out: list[Branch] = []
        for gen in generations:
            parsed = parse_action(gen.text)
            key = branch_key(parsed.kind, parsed.call, gen.text)
            if key in seen:
                seen[key].duplicates += 1
                continue
            branch = Branch(index=start + len(out), action_text=gen.text, kind=parsed.kind,
                            call=parsed.call, parse_error=parsed.error, sampled=gen.sampled,
                            act_logprob=round(gen.mean_logprob, 5) if gen.token_logprobs else None)
            seen[key] = branch
            out.append(branch)
        return out

    def _rehearse(self, branches: list[Branch], tools: dict[str, Tool]) -> int:
        """Predict the response of every call branch in one batched pass; returns the count."""
        todo = [b for b in branches if b.kind == "call" and b.predicted_text is None]
        if not todo:
            return 0
        # Rehearsal happens before the commit, so the pre-step state is the state to show.
        state = self._state_before if self.settings.rehearsal_context == "history+state" else None
        prompts = [rehearse_prompt(tools.get(b.call.name), b.call, self.history, state,
                                   constrain=self.settings.constrain) for b in todo]
        config = GenerationConfig(max_new_tokens=self.settings.max_rehearsal_tokens, temperature=0.0,
                                  seed=self.settings.seed, stop=REHEARSE_STOP)
        for branch, prompt, gen in zip(todo, prompts, self.policy.rehearse(prompts, config)):
            branch.predicted_text = gen.text
            branch.predicted, error = parse_result(gen.text)
            self._predicted_valid[branch.index] = error is None
            self._rehearse_prompts[branch.index] = prompt
        return len(todo)

    def _score(self, branches: list[Branch]) -> None:
        selector = self.settings.selector
        if selector == "judge":
            raw = selection.judge_scores(self.policy, self._request(), self.history, branches)
        else:  # logprob (and the base score under memory)
            raw = [b.act_logprob if b.act_logprob is not None else 0.0 for b in branches]
            selector = "logprob"
        selection.apply_scores(branches, selector, raw)

    def _decide(self, state_before: dict[str, Any]) -> Step:
        index = len(self.episode.steps)
        tools_list = self.env.tools()
        tools = {t.name: t for t in tools_list}
        self._rehearse_prompts, self._predicted_valid = {}, {}
        self._state_before = state_before
        rehearsals = 0
        mode = self.settings.mode
        if mode == "sequential":
            branches, chosen, rehearsals = self._sequential(index, tools_list, tools)
        else:
            k = 1 if mode == "none" else self.settings.branches
            branches = self._branches(self.policy.act(self._act_prompt(tools_list), k, self._act_config(index)))
            if mode == "none":
                chosen = 0
            else:
                rehearsals = self._rehearse(branches, tools)
                self._score(branches)
                if self.settings.selector == "memory":
                    chosen, extra = self._memory_choice(index, tools_list, tools, branches)
                    rehearsals += extra
                else:
                    chosen = selection.choose(branches, self.settings.selector)
        branches[chosen].chosen = True
        with self.timings.phase("shadow"):
            shadow_calls = self._shadow(branches, chosen, tools)
        with self.timings.phase("commit"):
            external = self._commit(branches[chosen])
        self._measure(branches)
        return Step(index=index, turn=self.turn, branches=branches, chosen=chosen,
                    kind=branches[chosen].kind, state_before=state_before,
                    state_after=self.env.state(), rehearsals=rehearsals,
                    shadow_calls=shadow_calls, external_calls=external)

    def _memory_choice(self, index: int, tools_list: list[Tool], tools: dict[str, Tool],
                       branches: list[Branch]) -> tuple[int, int]:
        """The policy sees its private rehearsals and writes the committed action."""
        memory = [(b.call, b.predicted) for b in branches if b.kind == "call"]
        if not memory:
            return selection.choose(branches, "logprob"), 0
        gen = self.policy.act(self._act_prompt(tools_list, memory=memory), 1, self._act_config(index, 1))[0]
        seen = {branch_key(b.kind, b.call, b.action_text): b for b in branches}
        new = self._branches([gen], start=len(branches), seen=seen)
        parsed = parse_action(gen.text)
        key = branch_key(parsed.kind, parsed.call, gen.text)
        extra = 0
        if new:
            branches.extend(new)
            extra = self._rehearse(new, tools)
        chosen = seen[key].index
        for b in branches:
            b.scores["memory"] = 1.0 if b.index == chosen else 0.0
        return chosen, extra

    def _sequential(self, index: int, tools_list: list[Tool],
                    tools: dict[str, Tool]) -> tuple[list[Branch], int, int]:
        """Rehearse; while the rehearsal predicts failure, propose again with the rehearsals in view."""
        branches: list[Branch] = []
        seen: dict[str, Branch] = {}
        memory: list[tuple[Any, Any]] = []
        rehearsals = 0
        for attempt in range(self.settings.branches):
            prompt = self._act_prompt(tools_list, memory=memory or None)
            # From the second attempt on, a sampled alternative stands in when greedy repeats itself.
            k = 1 if attempt == 0 else 2
            new = self._branches(self.policy.act(prompt, k, self._act_config(index, attempt)),
                                 start=len(branches), seen=seen)[:1]
            if not new:
                continue
            branch = new[0]
            branches.append(branch)
            if branch.kind != "call":
                if branch.kind == "answer":
                    return branches, branch.index, rehearsals
                continue
            rehearsals += self._rehearse([branch], tools)
            self._score([branch])
            score = branch.scores.get(self.settings.selector if self.settings.selector == "judge" else "logprob", 0)
            fails = selection.predicts_failure(branch, self.settings.selector, score)
            if not fails:
                return branches, branch.index, rehearsals
            memory.append((branch.call, branch.predicted))
        if not branches:  # every attempt repeated an earlier one: commit the greedy primary
            branches = self._branches(self.policy.act(self._act_prompt(tools_list), 1, self._act_config(index)))
            return branches, 0, rehearsals
        key = "judge" if self.settings.selector == "judge" else "logprob"
        return branches, selection.choose(branches, key), rehearsals

    # ------------------------------------------------------------ execution

    def _shadow(self, branches: list[Branch], chosen: int, tools: dict[str, Tool]) -> int:
        """Run each non-chosen call on its own fork of the pre-step state (inspection only).

        Runs before the commit, so a fork is the state the agent decided in. Writes run too
        where the environment forks in memory (`forkable`); elsewhere only read-only tools.
        The episode's environment is never called. Returns the shadow calls made.
        """
        forkable = bool(getattr(self.env, "forkable", False))
        count = 0
        for b in branches:
            if b.index == chosen or b.kind != "call" or b.actual_source is not None:
                continue
            tool = tools.get(b.call.name)
            if not self.settings.shadow:
                b.not_executed = NOT_EXECUTED_SHADOW_OFF
                continue
            if not forkable and (tool is None or not tool.read_only):
                b.not_executed = NOT_EXECUTED_CANNOT_FORK
                continue
            fork = self.env.fork()
            result = fork.call(b.call.name, b.call.arguments)
            b.actual, b.actual_error, b.actual_source = result.output, result.error, "shadow"
            b.shadow_state_after = fork.state()
            if hasattr(fork, "close"):  # an MCP fork holds a server process: end it now, not at garbage collection
                fork.close()
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
            result = self.env.call(branch.call.name, branch.call.arguments)
            branch.actual, branch.actual_error, branch.actual_source = result.output, result.error, "committed"
            self._turn_executed.append((branch.call.name, branch.call.arguments, result.output))
            external = 1
        self.history += committed_messages(branch, self.turn)
        return external

    def _measure(self, branches: list[Branch]) -> None:
        """Divergence metrics, with `surprise` from one batched scoring pass."""
        measured = [b for b in branches if b.predicted_text is not None and b.actual_source is not None
                    and b.index in self._rehearse_prompts]
        if not measured:
            return
        try:
            logprobs = self.policy.score([self._rehearse_prompts[b.index] for b in measured],
                                         [rehearse_target(b.actual) for b in measured])
        except RemoteCapabilityError:  # a server without prompt log-probabilities: no surprise
            logprobs = [[] for _ in measured]
        for b, lps in zip(measured, logprobs):
            b.metrics = compare(b.predicted, self._predicted_valid[b.index], b.actual, surprise=_round(mean_nll(lps)))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


__all__ = ["EpisodeRunner", "NOT_EXECUTED_CANNOT_FORK", "NOT_EXECUTED_SHADOW_OFF", "step_seed", "canonical_json"]
