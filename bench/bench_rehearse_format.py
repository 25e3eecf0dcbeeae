"""What a Rehearse prompt that continues the Act prompt would save (the speed side only: no training).

Today's Rehearse prompt (`formats.rehearse_prompt`) is its own conversation: the episode's calls and results,
then the called tool's signature, parameters and response schema, then the call. Each distinct tool of a
step's candidates is a different 130-195-token suffix to encode, which is most of what K=4 adds to a step.
The alternative measured here writes the call after the step's Act prompt (`<tool_call>{call}</tool_call>`,
then `<execution_result>`), whose KV the prefix cache already holds from the Act pass, so each row encodes
only its call. The shipped adapter was not trained on it, so the predicted texts mean nothing: both formats
decode a fixed 20 tokens, greedy, without stop strings, and only their seconds are compared.

For K=1 and K=4 (parallel, logprob selector, sampled candidates, the product's defaults) on the first 12
held-out tasks x 3 steps: each step is run and timed as it is, its Act and Rehearse prompts are kept; then,
per step, both formats' Rehearse calls are timed with the caches as a step has them (the Act prompt's KV for
the new format; the history's for today's), and the step's time is estimated with the new format's instead
of today's: measured step + (new - today). Writes bench/results/rehearse_format.json.
Run: `.venv/bin/python bench/bench_rehearse_format.py [--tasks 12] [--steps 3]`.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from common import paired_ratio, write_results
from tqdm import tqdm

from app import envs
from app.config import DEFAULT_RELEVANCE, SHIPPED_ADAPTER
from app.engine import EpisodeRunner
from app.engine.proposals import opened
from app.formats import RESULT_OPEN, TOOL_CALL_CLOSE
from app.records import RunSettings
from model_backend import GenerationConfig, Prompt

FIXED = GenerationConfig(max_new_tokens=20, temperature=0.0, stop=())
ONE = GenerationConfig(max_new_tokens=1, temperature=0.0, stop=())


def continued(act: Prompt, rehearse: Prompt) -> Prompt:
    """The call of a Rehearse prompt, written after the Act prompt, with the result opened."""
    call = rehearse.messages[-1]["content"].rsplit("\nCall: ", 1)[1]
    return Prompt(act.messages, prefill=opened(act) + call + TOOL_CALL_CLOSE + "\n" + RESULT_OPEN)


def history_part(rehearse: Prompt) -> Prompt:
    """Today's Rehearse prompt up to the tool: what the prefix cache holds from the step before."""
    shared = rehearse.messages[-1]["content"].split("\n\nTool: ", 1)[0]
    return Prompt(rehearse.messages[:-1] + [{"role": "user", "content": shared}])


def timed_rehearse(policy: Any, prompts: list[Prompt], warm: Prompt, act: bool) -> float:
    policy.reset_cache()
    policy.forget_scores()
    (policy.act(warm, 1, ONE) if act else policy.rehearse([warm], ONE))  # the cache as the step has it
    start = time.perf_counter()
    policy.rehearse(prompts, FIXED)
    return time.perf_counter() - start


def run(policy: Any, task_ids: list[str], k: int, steps: int) -> list[dict]:
    """Each step's measured seconds and both formats' Rehearse seconds."""
    settings = RunSettings(mode="parallel", branches=k, selector="logprob", seed=0, shadow=True,
                           proposal="sample", relevance=DEFAULT_RELEVANCE)
    kept: dict[str, Any] = {}
    act, rehearse = policy.act, policy.rehearse

    def keep_act(prompt: Prompt, n: int, config: GenerationConfig) -> Any:
        kept.setdefault("act", prompt)  # the step's Act prompt (a re-aimed call is `act_each`)
        return act(prompt, n, config)

    def keep_rehearse(prompts: list[Prompt], config: GenerationConfig) -> Any:
        kept.setdefault("rehearse", []).extend(prompts)
        return rehearse(prompts, config)

    EpisodeRunner(envs.load_task(task_ids[0]), policy, settings).step()  # warm-up
    policy.forget_scores()
    measured = []
    for task_id in tqdm(task_ids, desc=f"K={k}"):
        policy.reset_cache()
        policy.forget_scores(prompts=False)
        runner = EpisodeRunner(envs.load_task(task_id), policy, settings)
        for i in range(steps):
            kept.clear()
            policy.act, policy.rehearse = keep_act, keep_rehearse
            try:
                start = time.perf_counter()
                runner.step()
                seconds = time.perf_counter() - start
            finally:
                policy.act, policy.rehearse = act, rehearse
            measured.append({"task": task_id, "step": i, "seconds": seconds, "act": kept.get("act"),
                             "rehearse": kept.get("rehearse", [])})
            if runner.done:
                break
    for row in measured:
        prompts, act_prompt = row.pop("rehearse"), row.pop("act")
        row["rows"] = len(prompts)
        row["today_s"] = row["continued_s"] = 0.0
        if prompts and act_prompt is not None:
            row["today_s"] = timed_rehearse(policy, prompts, history_part(prompts[0]), act=False)
            row["continued_s"] = timed_rehearse(policy, [continued(act_prompt, p) for p in prompts], act_prompt,
                                                act=True)
        row["estimated_s"] = row["seconds"] + row["continued_s"] - row["today_s"]
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=12, help="first N held-out tasks")
    parser.add_argument("--steps", type=int, default=3, help="steps per episode")
    args = parser.parse_args()
    import model_backend

    policy = model_backend.load_policy("embedded", adapter=SHIPPED_ADAPTER)
    task_ids = envs.list_tasks("multi_turn_base", "heldout")[: args.tasks]
    out: dict[str, Any] = {"tasks": task_ids, "new_tokens": FIXED.max_new_tokens, "by_k": {}}
    for k in (1, 4):
        steps = run(policy, task_ids, k, args.steps)
        p50 = {key: statistics.median(s[key] for s in steps) for key in ("seconds", "estimated_s")}
        with_rows = [s for s in steps if s["rows"]]
        out["by_k"][str(k)] = {
            "steps": len(steps), "step_p50_s": round(p50["seconds"], 2),
            "step_p50_continued_s": round(p50["estimated_s"], 2),
            "rehearse_today_mean_s": round(statistics.mean(s["today_s"] for s in with_rows), 3),
            "rehearse_continued_mean_s": round(statistics.mean(s["continued_s"] for s in with_rows), 3),
            "rows_mean": round(statistics.mean(s["rows"] for s in with_rows), 2), "per_step": steps}
        print(f"K={k}: step p50 {p50['seconds']:.2f} s today, {p50['estimated_s']:.2f} s with the Rehearse prompt "
              f"continuing the Act prompt; a step's Rehearse ({out['by_k'][str(k)]['rows_mean']} rows, 20 tokens) "
              f"{out['by_k'][str(k)]['rehearse_today_mean_s']:.3f} -> "
              f"{out['by_k'][str(k)]['rehearse_continued_mean_s']:.3f} s (mean)")
    one, four = out["by_k"]["1"], out["by_k"]["4"]
    out["ratio_today"] = round(four["step_p50_s"] / one["step_p50_s"], 2)
    out["ratio_continued"] = round(four["step_p50_continued_s"] / one["step_p50_continued_s"], 2)
    out["paired_today"] = paired_ratio(one["per_step"], four["per_step"])
    out["paired_continued"] = paired_ratio(one["per_step"], four["per_step"], "estimated_s")
    print(f"K=4 / K=1 (p50): {out['ratio_today']} today, {out['ratio_continued']} with the Act-continued Rehearse "
          f"prompt (goal 1.3); per (task, step) pair, median {out['paired_today']} -> {out['paired_continued']}")
    write_results("rehearse_format", out)


if __name__ == "__main__":
    main()
