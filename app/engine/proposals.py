"""How a step's K candidates come to differ (`RunSettings.proposal`).

- `sample`: the greedy action, then K-1 actions sampled at the temperature. With a small
  model the samples mostly repeat the greedy tool with other arguments, so the selector
  chooses among variations of one guess.
- `tools`: the greedy action, then one greedy call to each of the K-1 tools the model
  ranks next (P(tool name | prompt, `<tool_call>{"name": "`), one batched scoring pass).
  The candidates name K distinct tools: the model's own alternatives, each with its best
  arguments, so rehearsal compares different ideas. On held-out BFCL the expert's tool is
  the model's first choice at one call step in five but in its top three at one in two
  (teacher-forced): the gap this aims at. Measured on the card's protocol with the shipped
  adapter it did not raise call accuracy (README, Evaluation), so `sample` stays the default.

A tool-forced alternative keeps the token log-probabilities of its tool name (from the
ranking pass) ahead of its generated ones, so `logprob` still compares whole calls.
"""
from __future__ import annotations

from app.envs.base import Tool
from app.formats import TOOL_CALL_OPEN, act_constraint, parse_action
from model_backend.base import Generation, GenerationConfig, Policy, Prompt

NAME_OPEN = '{"name": "'
"""How a call's JSON starts (`formats.call_text`): the name follows."""


def opened(prompt: Prompt) -> str:
    """The prompt's prefill with the call opened (`<tool_call>`), whether or not it already was."""
    return prompt.prefill if prompt.prefill.endswith(TOOL_CALL_OPEN) else prompt.prefill + TOOL_CALL_OPEN


def rank_tools(policy: Policy, prompt: Prompt, tools: list[Tool]) -> list[tuple[Tool, list[float]]]:
    """`tools` with the token log-probabilities of each name (closing quote included) right after
    `<tool_call>{"name": "`, most likely first (ties keep the prompt's order)."""
    ranking = Prompt(prompt.messages, prefill=opened(prompt) + NAME_OPEN)
    logprobs = policy.score([ranking] * len(tools), [t.name + '"' for t in tools])
    order = sorted(range(len(tools)), key=lambda i: -sum(logprobs[i]))
    return [(tools[i], logprobs[i]) for i in order]


def forced_tool_prompt(prompt: Prompt, tool: Tool) -> Prompt:
    """The Act prompt with the call opened on `tool`: constrained to its schema when the prompt
    is constrained, else with the name written into the prefill."""
    prefill = opened(prompt)
    if prompt.constraint is not None:
        return Prompt(prompt.messages, prefill=prefill, constraint=act_constraint([tool], prefill))
    return Prompt(prompt.messages, prefill=f'{prefill}{NAME_OPEN}{tool.name}", "arguments": ',
                  constraint=None)


def distinct_tools(policy: Policy, prompt: Prompt, tools: list[Tool], k: int,
                   config: GenerationConfig) -> list[Generation]:
    """The greedy action, then greedy calls to the K-1 most likely tools it does not call."""
    greedy = policy.act(prompt, 1, config)
    if k < 2 or len(tools) < 2:
        return greedy
    first = parse_action(greedy[0].text)
    taken = first.call.name if first.kind == "call" and first.call is not None else None
    ranked = [(t, lps) for t, lps in rank_tools(policy, prompt, tools) if t.name != taken][: k - 1]
    alternatives = policy.act_each([forced_tool_prompt(prompt, t) for t, _ in ranked],
                                   GenerationConfig(max_new_tokens=config.max_new_tokens, temperature=0.0,
                                                    seed=config.seed, stop=config.stop))
    out = list(greedy)
    for (tool, name_lps), gen in zip(ranked, alternatives):
        lps = gen.token_logprobs if prompt.constraint is not None else name_lps + gen.token_logprobs
        out.append(Generation(gen.text, lps, gen.finished, sampled=True))
    return out


__all__ = ["NAME_OPEN", "distinct_tools", "forced_tool_prompt", "rank_tools"]
