"""Scoring branches and choosing the one to commit.

Selectors (docs/DESIGN.md): `judge` (the model's own P("yes") that the rehearsed outcome
advances the task), `logprob` (the Act role's mean token log-probability, plus a call's tool
log-probability when tools were ranked, `proposals`), `memory` (the rehearsals are shown to the
policy, which writes the committed call). A branch whose rehearsal predicts an error is
penalised under every selector: foreseeing that failure is what rehearsal is for. With tools
ranked, `logprob` keeps the primary unless its rehearsal predicts an error.

Each selector is a small object (`context.Selector`): `score` writes `Branch.scores[score_key]`,
`choose` returns the index to commit; it reads the step's conversation (`ctx.history`) and
asks the model through the step's planner (`ctx.planner`). The table of them by name is `strategies.SELECTOR_TABLE`;
the evaluation-only `oracle` selector lives in `oracle.py`.
"""
from __future__ import annotations

import math
from typing import Any

from app.divergence import is_error
from app.engine.context import StepContext
from app.engine.history import latest_request
from app.engine.proposals import TOOL_SCORE
from app.formats import HistoryItem, call_text, judge_prompt
from app.records import Branch
from model_backend.base import NO_PROMPT_LOGPROBS, Policy, RemoteCapabilityError

PREDICTED_ERROR_PENALTY = 0.5
"""Subtracted when the rehearsal predicts an error (scores are probabilities or mean log-probs)."""
PARSE_ERROR_SCORE = -10.0
"""Below any real score: a malformed action is committed only when every branch is malformed."""


def branch_summary(branch: Branch) -> str:
    if branch.kind == "call" and branch.call is not None:
        return call_text(branch.call)
    if branch.kind == "answer":
        return f"reply to the user: {branch.action_text.strip()[:300]}"
    return branch.action_text[:300]


def check_selector(policy: Policy, selector: str, mode: str) -> None:
    """Refuse up front what the policy cannot score: `judge` needs prompt log-probabilities."""
    if selector == "judge" and mode != "none" and not policy.supports_scoring:
        raise RemoteCapabilityError(NO_PROMPT_LOGPROBS)


def judge_scores(policy: Policy, request: str, history: list[HistoryItem],
                 branches: list[Branch]) -> list[float]:
    """P(yes) per branch from one batched scoring pass (two continuations per branch)."""
    prompts, conts = [], []
    for b in branches:
        predicted: Any = b.predicted if b.kind == "call" else "(the turn ends)"
        p = judge_prompt(request, history, branch_summary(b), predicted)
        prompts += [p, p]
        conts += ["yes", "no"]
    logprobs = policy.score(prompts, conts) if prompts else []
    out = []
    for i in range(len(branches)):
        yes, no = sum(logprobs[2 * i]), sum(logprobs[2 * i + 1])
        top = max(yes, no)
        out.append(math.exp(yes - top) / (math.exp(yes - top) + math.exp(no - top)))
    return out


def predicted_error(branch: Branch) -> bool:
    """The branch is a call whose rehearsal predicts an error."""
    return branch.kind == "call" and branch.predicted_text is not None and is_error(branch.predicted)


def apply_scores(branches: list[Branch], selector: str, raw: list[float]) -> None:
    """Write `scores[selector]` with the predicted-error penalty and the parse-error floor."""
    for b, value in zip(branches, raw):
        if b.kind == "parse_error":
            value = PARSE_ERROR_SCORE
        elif predicted_error(b):
            value -= PREDICTED_ERROR_PENALTY
        b.scores[selector] = round(float(value), 5)


def choose(branches: list[Branch], selector: str) -> int:
    """Highest score wins; ties go to the lower index (the greedy primary first)."""
    best = 0
    for i, b in enumerate(branches):
        if b.scores.get(selector, PARSE_ERROR_SCORE) > branches[best].scores.get(selector, PARSE_ERROR_SCORE):
            best = i
    return best


def keep_primary(branches: list[Branch], chosen: int) -> int:
    """The greedy primary (branch 0) unless the selector's choice is backed by the one evidence measured to be
    reliable: the primary's rehearsal predicts an error and the chosen branch's does not. On held-out turns the
    judge's and log-probability's margins between branches are mostly within noise (0.01 apart), and moving
    off the primary on them passed fewer turns than committing the primary (issue 35)."""
    if chosen == 0 or not branches or branches[0].kind == "parse_error":
        return chosen
    if predicted_error(branches[0]) and not predicted_error(branches[chosen]):
        return chosen
    return 0


class LogprobSelector:
    """The Act role's mean token log-probability (no extra model pass)."""

    name = score_key = "logprob"

    def score(self, ctx: StepContext, branches: list[Branch]) -> None:
        # With tools ranked (`RunSettings.relevance`), a call's tool's log-probability under the ranking counts too.
        apply_scores(branches, "logprob", [(b.act_logprob if b.act_logprob is not None else 0.0)
                                           + b.scores.get(TOOL_SCORE, 0.0) for b in branches])

    def choose(self, ctx: StepContext, branches: list[Branch]) -> int:
        # With tools ranked, the primary is the ranking's call: rehearsal vetoes it only by foreseeing an error.
        # (Mean token log-probabilities favour a fluent stock answer over a call the ranking re-aimed.)
        if ctx.tool_log_p and branches and not predicted_error(branches[0]):
            return 0
        return choose(branches, self.score_key)


class JudgeSelector:
    """The model's own P("yes") that the rehearsed outcome advances the request."""

    name = score_key = "judge"

    def score(self, ctx: StepContext, branches: list[Branch]) -> None:
        history = ctx.history
        apply_scores(branches, "judge", judge_scores(ctx.planner.policy, latest_request(history), history, branches))

    def choose(self, ctx: StepContext, branches: list[Branch]) -> int:
        return choose(branches, self.score_key)


class MemorySelector(LogprobSelector):
    """The policy sees its private rehearsals and writes the committed action (one more Act pass).

    A new action becomes a branch of its own (rehearsed like the others); one equal to a
    candidate commits that candidate. `scores["memory"]` marks the choice.
    """

    name = "memory"
    score_key = "logprob"

    def choose(self, ctx: StepContext, branches: list[Branch]) -> int:
        memory = [(b.call, b.predicted) for b in branches if b.kind == "call"]
        if not memory:
            return choose(branches, "logprob")
        planner = ctx.planner
        generation = planner.generate(ctx, 1, memory=memory, attempt=1)[0]
        new = planner.parse_branches(ctx, [generation])
        if new:
            branches.extend(new)
            planner.rehearse(ctx, new)
        chosen = ctx.seen[planner.key_of(generation)].index
        for b in branches:
            b.scores["memory"] = 1.0 if b.index == chosen else 0.0
        return chosen


def predicts_failure(branch: Branch, selector: str, score: float) -> bool:
    """Sequential mode: propose again when the rehearsal foresees an error (or the judge says no)."""
    if predicted_error(branch):
        return True
    return selector == "judge" and score < 0.5
