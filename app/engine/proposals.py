"""Which tool a step calls, and how its K candidates come to differ.

Tool ranking. A small model's first choice of tool is often wrong while the right tool is
close behind (teacher-forced on held-out BFCL, the expert's tool is the shipped adapter's
first choice at 49 of 154 expert call steps, in its top three at 99). Two scores from the
model's own weights rank the tools of a step:

- `direct`: log P(tool name | Act prompt, `<tool_call>{"name": "`), one batched scoring pass;
- `relevance`: log P(user request | a line describing the tool), the noisy channel
  (Min et al. 2022, "Noisy Channel Language Model Prompting"): how well each tool explains
  the request, which a direct model biased toward frequent names does not weigh. One batched
  pass per user turn (the request and the tools stay the same within a turn), over the
  `RunSettings.relevance_top` tools the direct score ranks first (default 0: every tool, 17-35 a
  task): a tool outside them takes the lowest relevance computed, so it ranks below the direct
  score's last scored tool, and the order among the scored ones is the full channel's. A step
  whose greedy action answers computes none. `bench/bench_step.py --relevance-tops 0,8` times a
  task's first step and measures the ranking's call accuracy under both in one run
  (bench/results/step_latency_channel.json, 2026-12-07, quiet 2 cores, K=4, 8 tasks: a first step's p50
  6.91 s with every tool, 4.53 s with 8; the expert's tool first at 24 of 67 expert call steps against 23,
  so every tool stays the default).

A tool's score is `direct + RunSettings.relevance * relevance`. With `relevance` > 0 the
step's primary call is re-aimed at the top-scoring tool when the greedy action calls
another (the greedy action still decides between calling and answering), and every call
branch carries its tool's log-probability under the ranking relative to the top tool's
(`Branch.scores["tool"]`, 0 for the top tool), which the `logprob` selector adds (`selection`);
that selector keeps the primary unless its rehearsal foresees an error.

Candidates (`RunSettings.proposal`):
- `sample`: the primary, then K-1 actions sampled at the temperature. With a small model
  the samples mostly repeat the primary's tool with other arguments.
- `tools`: the primary, then one greedy call to each of the K-1 next tools of the ranking,
  so rehearsal compares different ideas.

A tool-forced call keeps the token log-probabilities of its tool name (from the ranking
pass) ahead of its generated ones when unconstrained, so `logprob` still compares whole calls.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from app.envs.base import Tool
from app.formats import TOOL_CALL_OPEN, act_constraint, parse_action
from model_backend.base import Generation, GenerationConfig, Policy, Prompt

NAME_OPEN = '{"name": "'
"""How a call's JSON starts (`formats.call_text`): the name follows."""
TOOL_SCORE = "tool"
"""`Branch.scores` key: the branch's tool's `RankedTool.log_p` minus the top tool's (0 for the top tool)."""
RELEVANCE_PROMPT = "Tool `{name}`: {description}\nWrite a request a user could make that needs this tool."
"""The channel's prompt: the request is scored as this message's reply."""


@dataclass
class RankedTool:
    tool: Tool
    name_logprobs: list[float]
    """Token log-probabilities of the name (closing quote included) after `<tool_call>{"name": "`."""
    relevance: float
    """log P(request | tool): 0.0 when no relevance was given, the lowest computed for a tool outside the
    channel's `top` (`rank_tools`)."""
    score: float
    """`sum(name_logprobs) + weight * relevance`: the ranking key."""
    log_p: float = 0.0
    """log of the score's softmax over the step's tools (the selector adds it relative to the top tool's)."""


def opened(prompt: Prompt) -> str:
    """The prompt's prefill with the call opened (`<tool_call>`), whether or not it already was."""
    return prompt.prefill if prompt.prefill.endswith(TOOL_CALL_OPEN) else prompt.prefill + TOOL_CALL_OPEN


def relevance(policy: Policy, request: str, tools: list[Tool]) -> dict[str, float]:
    """log P(`request` | a line describing the tool) per tool name, one batched scoring pass."""
    if not request.strip() or not tools:
        return {t.name: 0.0 for t in tools}
    prompts = [Prompt([{"role": "user", "content": RELEVANCE_PROMPT.format(name=t.name, description=t.description)}])
               for t in tools]
    logprobs = policy.score(prompts, [request] * len(tools))
    return {t.name: sum(lps) for t, lps in zip(tools, logprobs)}


RelevanceOf = Callable[[list[Tool]], dict[str, float]]
"""Computes `relevance` for the tools it is given (the runner's, kept per user turn)."""


def rank_tools(policy: Policy, prompt: Prompt, tools: list[Tool],
               relevance_by_name: dict[str, float] | RelevanceOf | None = None, weight: float = 0.0,
               top: int = 0) -> list[RankedTool]:
    """`tools` by `direct + weight * relevance`, best first (ties keep the prompt's order). `relevance_by_name`
    given as a function is asked for the `top` tools of the direct score only (0: every tool), and a tool outside
    them takes the lowest relevance it returned."""
    ranking = Prompt(prompt.messages, prefill=opened(prompt) + NAME_OPEN)
    logprobs = policy.score([ranking] * len(tools), [t.name + '"' for t in tools])
    floor = 0.0
    if callable(relevance_by_name):
        by_direct = sorted(range(len(tools)), key=lambda i: -sum(logprobs[i]))  # stable: ties keep the order
        asked = [tools[i] for i in by_direct[:top]] if 0 < top < len(tools) else tools
        rel = relevance_by_name(asked) if weight > 0 else {}
        floor = min(rel.values(), default=0.0)
    else:
        rel = relevance_by_name or {}
    ranked = [RankedTool(t, lps, rel.get(t.name, floor), sum(lps) + weight * rel.get(t.name, floor))
              for t, lps in zip(tools, logprobs)]
    ranked.sort(key=lambda r: -r.score)
    if ranked:
        top = ranked[0].score
        log_z = top + math.log(sum(math.exp(r.score - top) for r in ranked))
        for r in ranked:
            r.log_p = r.score - log_z
    return ranked


def forced_tool_prompt(prompt: Prompt, tool: Tool) -> Prompt:
    """The Act prompt with the call opened on `tool`: constrained to its schema when the prompt
    is constrained, else with the name written into the prefill."""
    prefill = opened(prompt)
    if prompt.constraint is not None:
        return Prompt(prompt.messages, prefill=prefill, constraint=act_constraint([tool], prefill))
    return Prompt(prompt.messages, prefill=f'{prefill}{NAME_OPEN}{tool.name}", "arguments": ',
                  constraint=None)


def called_tool(generation: Generation) -> str | None:
    parsed = parse_action(generation.text)
    return parsed.call.name if parsed.kind == "call" and parsed.call is not None else None


def forced_calls(policy: Policy, prompt: Prompt, ranked: list[RankedTool], config: GenerationConfig,
                 primary: bool = False) -> list[Generation]:
    """One greedy call to each ranked tool, in one batch; all but a `primary` first one are alternatives."""
    if not ranked:
        return []
    gens = policy.act_each([forced_tool_prompt(prompt, r.tool) for r in ranked],
                           GenerationConfig(max_new_tokens=config.max_new_tokens, temperature=0.0,
                                            seed=config.seed, stop=config.stop))
    return [Generation(gen.text, gen.token_logprobs if prompt.constraint is not None else r.name_logprobs + gen.token_logprobs,
                       gen.finished, sampled=not (primary and i == 0))
            for i, (r, gen) in enumerate(zip(ranked, gens))]


def propose(policy: Policy, prompt: Prompt, tools: list[Tool], k: int, config: GenerationConfig, proposal: str,
            relevance_by_name: dict[str, float] | RelevanceOf | None = None,
            weight: float = 0.0, top: int = 0) -> tuple[list[Generation], dict[str, float]]:
    """The step's K candidates and, when tools were ranked with a relevance weight, each tool's `log_p`
    (`relevance_by_name` and `top` as in `rank_tools`: a function is asked only when the tools are ranked)."""
    distinct = proposal == "tools" and k > 1 and len(tools) > 1
    retool = weight > 0 and len(tools) > 1
    gens = policy.act(prompt, 1 if distinct else k, config)
    if not (distinct or retool):
        return gens, {}
    taken = called_tool(gens[0])
    if taken is None and not distinct:  # the greedy action answers (or failed to parse): nothing to re-aim
        return gens, {}
    ranked = rank_tools(policy, prompt, tools, relevance_by_name, weight, top)
    # Relative to the top tool (0 for it), so that a call to the top tool and a plain answer still
    # compare by their Act log-probabilities alone, as without a ranking.
    log_p = {r.tool.name: r.log_p - ranked[0].log_p for r in ranked} if weight > 0 else {}
    reaim = taken is not None and retool and ranked[0].tool.name != taken
    if reaim:
        taken = ranked[0].tool.name
    others = [r for r in ranked if r.tool.name != taken][: k - 1] if distinct else []
    forced = forced_calls(policy, prompt, ranked[:1] * reaim + others, config, primary=reaim)  # one batch
    if reaim:
        gens[0], forced = forced[0], forced[1:]
    return ([gens[0], *forced] if distinct else gens), log_p


__all__ = ["NAME_OPEN", "TOOL_SCORE", "RankedTool", "RelevanceOf", "forced_tool_prompt", "propose", "rank_tools",
           "relevance"]
