"""One agent decision, planned from a conversation: the `StepPlanner`.

Planning a step: Act proposes K candidates (`generate`: which tool the primary calls and how the others
differ, `proposals`) -> they become branches, duplicates folded (`parse_branches`, `key_of`) -> each call
is rehearsed (`rehearse`, through the planner's `Rehearser`, retrieving from the rehearsal memory:
`recall`) -> the selector scores them and picks one. How a step proposes and picks is looked up by name
(`strategies.MODE_TABLE`, `strategies.SELECTOR_TABLE`); `plan` runs the mode. After the commit, `measure`
scores every branch that has both a prediction and an actual response (divergence, surprise).

The planner owns the policy, the settings, the rehearser, the selector, the memory it retrieves from (in
its `MemoryScope`) and the relevance cache (the open request's channel scores, reused for the turn). It
plans on the conversation and tools it is given in the `StepContext` (`context`), never on an episode:
the `EpisodeRunner` plans each step of an episode through one (and executes, commits and judges), the
world model and the offline rehearsal of a recorded trace plan a step with no task, environment or judge.
"""
from __future__ import annotations

import copy
import logging
from typing import Any

from app.divergence import compare, mean_nll
from app.engine import proposals, strategies
from app.engine.context import EpisodeView, StepContext
from app.engine.history import call_required, latest_request
from app.engine.memory import MemoryScope, RehearsalMemory
from app.engine.proposals import TOOL_SCORE
from app.engine.rehearsers import Rehearser
from app.envs.base import Tool
from app.formats import (ACT_STOP, TOOL_CALL_OPEN, HistoryItem, act_prompt, branch_key, parse_action,
                         rehearse_target)
from app.records import Branch, Call, MemoryHit, RunSettings
from model_backend.base import Generation, GenerationConfig, Policy, Prompt, RemoteCapabilityError

log = logging.getLogger(__name__)


def step_seed(seed: int, step_index: int, attempt: int = 0) -> int:
    """A distinct, reproducible seed per step (and per sequential attempt)."""
    return (seed * 1_000_003 + step_index * 101 + attempt) % (2**31 - 1)


class StepPlanner:
    """Plans one decision at a time: what the model proposes, rehearses and picks; nothing is executed for real."""

    def __init__(self, policy: Policy, settings: RunSettings, *, rehearser: Rehearser | None = None,
                 memory: RehearsalMemory | None = None, scope: MemoryScope | None = None) -> None:
        if settings.relevance > 0 and not policy.supports_scoring:
            # The ranking scores tool names and requests (prompt log-probabilities); a server without them
            # runs with the greedy action's tool, and the settings say so.
            log.warning("%s cannot score prompts: tool relevance off for these steps", policy.name)
            settings = settings.model_copy(update={"relevance": 0.0})
        self.rehearser: Rehearser = rehearser if rehearser is not None else strategies.rehearser_for(settings)
        """Fills in candidates' responses: the model's prediction, or (real best-of-K) execution on forks."""
        strategies.check_settings(settings, self.rehearser)
        self.selector = strategies.SELECTOR_TABLE[settings.selector]
        self.policy, self.settings = policy, settings
        self.memory = memory
        """Real transitions the Rehearse prompts retrieve from (`settings.memory` says which). None: no retrieval."""
        self.scope = scope if scope is not None else MemoryScope(settings.memory)
        """Which of the memory's transitions a rehearsal may retrieve (an episode's: `EpisodeRunner`)."""
        self.relevance_cache: dict[tuple[str, str], float] = {}
        """log P(request | tool) by (the open request, tool name): `_relevance`."""

    def context(self, index: int, tools: list[Tool], history: list[HistoryItem],
                state_before: dict[str, Any] | None = None, episode: EpisodeView | None = None) -> StepContext:
        """A fresh step's context: step `index` (seeds derive from it) over `tools`, planned on `history`."""
        return StepContext(planner=self, index=index, tools_list=tools, history=history, episode=episode,
                           state_before={} if state_before is None else state_before)

    def plan(self, ctx: StepContext) -> int:
        """Run the settings' mode on `ctx`: every branch ends in `ctx.branches`; returns the chosen index."""
        return strategies.MODE_TABLE[self.settings.mode](ctx)

    def scratch(self, policy: Policy) -> StepPlanner:
        """A copy planning with `policy` (computing ahead: the bare model, not the UI's wrapper), its own
        relevance cache starting from this one's (`keep_relevance` takes what it adds)."""
        out = copy.copy(self)
        out.policy, out.relevance_cache = policy, dict(self.relevance_cache)
        return out

    def keep_relevance(self, scratch: StepPlanner) -> None:
        """Keep the relevance scores a `scratch` copy computed."""
        self.relevance_cache.update(scratch.relevance_cache)

    # ------------------------------------------------------------ proposing

    def generate(self, ctx: StepContext, k: int, *, memory: list[tuple[Any, Any]] | None = None,
                 attempt: int = 0) -> list[Generation]:
        """K Act candidates for this step, with private rehearsals in view when `memory`; which tool the
        primary calls (`settings.relevance`) and how the others differ (`settings.proposal`): `proposals`."""
        prompt, config = self.act_prompt(ctx.tools_list, ctx.history, memory), self.act_config(ctx.index, attempt)
        weight = self.settings.relevance
        relevance = (lambda tools: self._relevance(ctx.history, tools)) if weight > 0 else None
        generations, log_p = proposals.propose(self.policy, prompt, ctx.tools_list, k, config, self.settings.proposal,
                                               relevance, weight, self.settings.relevance_top)
        ctx.tool_log_p.update(log_p)
        return generations

    def _relevance(self, history: list[HistoryItem], tools: list[Tool]) -> dict[str, float]:
        """`proposals.relevance` of the open turn's request for `tools`, each tool computed once a turn (the
        ranking asks for the direct score's first tools, which a later step of the turn may change)."""
        request = latest_request(history)
        if any(key[0] != request for key in self.relevance_cache):  # a new turn: the last one's are no use
            self.relevance_cache = {key: v for key, v in self.relevance_cache.items() if key[0] == request}
        missing = [t for t in tools if (request, t.name) not in self.relevance_cache]
        if missing:
            for name, value in proposals.relevance(self.policy, request, missing).items():
                self.relevance_cache[(request, name)] = value
        return {t.name: self.relevance_cache[(request, t.name)] for t in tools}

    def act_prompt(self, tools: list[Tool], history: list[HistoryItem],
                   memory: list[tuple[Any, Any]] | None = None) -> Prompt:
        prefill = TOOL_CALL_OPEN if call_required(self.settings.tool_choice, history) else ""
        return act_prompt(tools, history, self.policy.count_tokens, self.policy.context_window,
                          reserve=self.settings.max_action_tokens + 32, memory=memory, prefill=prefill,
                          constrain=self.settings.constrain)

    def act_config(self, index: int, attempt: int = 0) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=self.settings.max_action_tokens,
                                temperature=self.settings.temperature,
                                seed=step_seed(self.settings.seed, index, attempt), stop=ACT_STOP)

    @staticmethod
    def key_of(generation: Generation) -> str:
        """The dedup key of a candidate (`formats.branch_key` of its parsed action)."""
        parsed = parse_action(generation.text)
        return branch_key(parsed.kind, parsed.call, generation.text)

    def parse_branches(self, ctx: StepContext, generations: list[Generation]) -> list[Branch]:
        """New branches from candidates, numbered after `ctx.branches`; a candidate equal to one in
        `ctx.seen` (same canonical call) is folded into it as a duplicate."""
        out: list[Branch] = []
        for gen in generations:
            parsed = parse_action(gen.text)
            key = branch_key(parsed.kind, parsed.call, gen.text)
            if key in ctx.seen:
                ctx.seen[key].duplicates += 1
                continue
            branch = Branch(index=len(ctx.branches) + len(out), action_text=gen.text, kind=parsed.kind,
                            call=parsed.call, parse_error=parsed.error, sampled=gen.sampled,
                            act_logprob=round(gen.mean_logprob, 5) if gen.token_logprobs else None)
            if parsed.call is not None and parsed.call.name in ctx.tool_log_p:
                branch.scores[TOOL_SCORE] = round(ctx.tool_log_p[parsed.call.name], 5)
            ctx.seen[key] = branch
            out.append(branch)
        return out

    # ------------------------------------------------------------ rehearsing

    def rehearse(self, ctx: StepContext, branches: list[Branch]) -> None:
        """Fill in the response of every call branch through the planner's rehearser."""
        ctx.rehearsals += self.rehearser.rehearse(ctx, branches)

    def recall(self, call: Call) -> list[MemoryHit]:
        """The real transitions a rehearsal of `call` is conditioned on (none without a memory)."""
        if self.memory is None:
            return []
        return self.memory.retrieve(call, self.scope, self.settings.memory_k)

    def measure(self, ctx: StepContext) -> None:
        """Divergence metrics, with `surprise` from one batched scoring pass."""
        measured = [b for b in ctx.branches if b.predicted_text is not None and b.actual_source is not None
                    and b.index in ctx.rehearse_prompts]
        if not measured:
            return
        try:
            logprobs = self.policy.score([ctx.rehearse_prompts[b.index] for b in measured],
                                         [rehearse_target(b.actual) for b in measured])
        except RemoteCapabilityError:  # a server without prompt log-probabilities: no surprise
            logprobs = [[] for _ in measured]
        for b, lps in zip(measured, logprobs):
            b.metrics = compare(b.predicted, ctx.predicted_valid[b.index], b.actual, surprise=_round(mean_nll(lps)))


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


__all__ = ["StepPlanner", "step_seed"]
