"""Where a step's time goes: the shipped agent, parallel rehearsal, K=1 and K=4, first held-out tasks.

A step is split into: Act tokenize / prefill / decode, Rehearse tokenize / prefill / decode,
scoring (the selector's and `surprise`'s forward passes, tokenization included), shadow
execution and the commit (real tool calls), the store write (`Recorder`, one transaction per
step, into a temporary SQLite file), the UI render (the Run tab's HTML and chat for the step),
and the rest of the engine (parsing, metrics, dedup). The product's defaults hold: constrained
decoding, shadow execution, the prefix cache, sampled alternatives (`--proposal tools` for the other kind). Writes `bench/results/step_latency.json` and a
plotly stacked bar `bench/results/step_breakdown.html` (and .png when kaleido is installed).

`--profile`: cProfile over every step instead (profiler overhead included, so no latency file is written):
the functions with the most time of their own per K, with their share, in `bench/results/step_profile.json`.

`--memory`: each K with the rehearsal memory off and seeded (the training split's transitions retrieved into every
Rehearse prompt, `app.engine.memory`), timed in the same run: writes `bench/results/step_latency_memory.json`.

`--state`: each K with the Rehearse prompt's context `history` and `history+state` (the default: the state before
the call, `app.formats.state_section`), timed in the same run: writes `bench/results/step_latency_state.json`.

`--ahead`: as the Run tab does, each step is computed ahead while a person would read the task picked or the
last step (`EpisodeRunner.compute_ahead`, timed apart: the reading time the wait assumes), then Step is timed:
the wait. Writes `bench/results/step_latency_ahead.json`.

`--relevance-tops 0,8`: the channel over every tool (0) against the direct score's first N tools
(`RunSettings.relevance_top`), in one run: each task's first `--steps` steps at each K under each value, interleaved
task by task (no result kept from one to the next), and the ranking's call accuracy under each value, teacher-forced
on the expert's call steps of the first `--accuracy-tasks` held-out tasks (the expert's tool ranked first).
Writes `bench/results/step_latency_channel.json`.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from common import RESULTS, paired_ratio, write_results
from tqdm import tqdm

from app import envs
from app.config import DEFAULT_RELEVANCE, SHIPPED_ADAPTER
from app.engine import EpisodeRunner
from app.records import DEFAULT_REHEARSAL_CONTEXT, PROPOSALS, RunSettings
from app.store import Recorder, Store
from app.ui import render

PHASES = ["act.tokenize", "act.prefill", "act.decode", "rehearse.tokenize", "rehearse.prefill",
          "rehearse.decode", "scoring", "shadow", "commit", "engine other", "store write", "UI render"]


def step_phases(runner: EpisodeRunner, recorder: Recorder, task: envs.Task,
                profile: cProfile.Profile | None = None) -> tuple[dict[str, float], bool]:
    """One step's seconds per phase (and whether the episode is over); `profile` profiles the step itself."""
    policy = runner.policy
    policy.timings.take()
    runner.timings.take()
    t0 = time.perf_counter()
    if profile is not None:
        profile.enable()
    step = runner.step()
    if profile is not None:
        profile.disable()
    total = time.perf_counter() - t0
    phases = {**policy.timings.take(), **runner.timings.take()}
    phases["scoring"] = phases.pop("score.tokenize", 0.0) + phases.pop("score.forward", 0.0)
    phases["engine other"] = max(0.0, total - sum(phases.values()))
    t1 = time.perf_counter()
    recorder(runner.episode, step)
    phases["store write"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    render.chat_messages(task.turns, runner.episode.steps, open_turn=step.turn)
    render.branch_cards(step)
    render.state_view(step)
    render.episode_status(runner.episode)
    phases["UI render"] = time.perf_counter() - t2
    return {p: phases.get(p, 0.0) for p in PHASES}, runner.done


def ranking_accuracy(policy, task_ids: list[str], tops: list[int], weight: float) -> dict[str, dict]:
    """Teacher-forced: at each expert call step of `task_ids`, whether the ranking (`proposals.rank_tools`, the
    channel asked for `top` tools) puts the expert's tool first, per `top`. The Act prompt is the runner's
    (`rows.act_row_prompt`); the channel's scores are kept across tops, so each is computed once."""
    from app.engine.history import latest_request
    from app.engine.proposals import rank_tools, relevance
    from app.engine.replay import replay
    from app.training.rows import PromptContext, act_row_prompt, expert_episode

    ctx = PromptContext(policy.count_tokens, policy.context_window, settings=RunSettings(relevance=weight))
    hits = {top: 0 for top in tops}
    steps = 0
    for task_id in tqdm(task_ids, desc="call accuracy"):
        task = envs.load_task(task_id)
        episode = expert_episode(task)
        for view in replay(episode, task):
            if view.step.kind != "call":
                continue
            steps += 1
            prompt, request = act_row_prompt(view, ctx), latest_request(view.history)
            for top in tops:
                ranked = rank_tools(policy, prompt, view.tools, lambda tools: relevance(policy, request, tools),
                                    weight, top)
                hits[top] += ranked[0].tool.name == view.step.chosen_branch.call.name
    return {str(top): {"call_steps": steps, "expert_tool_first": hits[top],
                       "call_accuracy": round(hits[top] / steps, 3)} for top in tops}


def channel_run(args, policy, task_ids: list[str]) -> None:
    """`--relevance-tops`: first steps' seconds and the ranking's call accuracy per channel size, in one run."""
    tops = [int(t) for t in args.relevance_tops.split(",")]
    store = Store(Path(tempfile.mkdtemp()) / "bench.db")
    rows: dict[str, dict] = {}
    for k in map(int, args.ks.split(",")):
        settings = {top: RunSettings(mode="parallel", branches=k, selector="logprob", seed=0, shadow=True,
                                     proposal=args.proposal, relevance=args.relevance, relevance_top=top)
                    for top in tops}
        EpisodeRunner(envs.load_task(task_ids[0]), policy, settings[tops[0]]).step()  # warm-up
        policy.forget_scores()
        totals = {top: [] for top in tops}
        scoring = {top: [] for top in tops}
        per_step = {top: [] for top in tops}
        for task_id in tqdm(task_ids, desc=f"K={k}"):
            task = envs.load_task(task_id)
            for top in tops:  # interleaved: the machine's load falls on both alike
                policy.reset_cache()
                policy.forget_scores(prompts=args.cold_prompts)
                runner = EpisodeRunner(task, policy, settings[top])
                recorder = Recorder(store)
                recorder.start(runner.episode)
                for i in range(args.steps):
                    phases, done = step_phases(runner, recorder, task)
                    seconds = sum(phases.values())
                    per_step[top].append({"task": task_id, "step": i, "seconds": round(seconds, 3),
                                          "scoring_s": round(phases["scoring"], 3)})
                    if i == 0:
                        totals[top].append(seconds)
                        scoring[top].append(phases["scoring"])
                    if done:
                        break
        for top in tops:
            rows[f"{k}/top{top}"] = {"first_steps": len(totals[top]),
                                     "first_steps_p50_s": round(statistics.median(totals[top]), 2),
                                     "first_steps_mean_s": round(statistics.mean(totals[top]), 2),
                                     "first_steps_scoring_p50_s": round(statistics.median(scoring[top]), 2),
                                     "per_step": per_step[top]}
            print(f"K={k}, channel over {'every tool' if top == 0 else f'the first {top} tools'}: first step p50 "
                  f"{rows[f'{k}/top{top}']['first_steps_p50_s']} s (scoring "
                  f"{rows[f'{k}/top{top}']['first_steps_scoring_p50_s']} s) over {len(totals[top])} tasks")
    policy.forget_scores()
    accuracy_ids = envs.list_tasks("multi_turn_base", "heldout")[: args.accuracy_tasks]
    accuracy = ranking_accuracy(policy, accuracy_ids, tops, args.relevance)
    for top, row in accuracy.items():
        print(f"channel top {top}: the expert's tool first at {row['expert_tool_first']} of {row['call_steps']} "
              f"call steps ({row['call_accuracy']})")
    write_results("step_latency_channel", {"adapter": SHIPPED_ADAPTER.name, "weights": policy.loaded.weights,
                                           "selector": "logprob", "proposal": args.proposal,
                                           "relevance": args.relevance, "cold_prompts": args.cold_prompts,
                                           "tasks": task_ids, "steps_per_task": args.steps, "results": rows,
                                           "accuracy_tasks": accuracy_ids, "call_accuracy": accuracy})


def top_functions(profile: cProfile.Profile, n: int = 20) -> list[dict]:
    """The `n` functions with the most time of their own, with their share of all profiled time."""
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, primitive calls, own, cumulative, callers)}
    total = sum(own for _, _, own, _, _ in stats.values())
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:n]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls, "own_s": round(own, 3),
             "share": round(own / total, 3)} for (file, line, name), (calls, _, own, _, _) in rows]


def figure(rows: dict[str, dict]) -> None:
    import plotly.graph_objects as go

    ks = list(rows)
    fig = go.Figure([go.Bar(name=p, x=[f"K={k}" for k in ks], y=[rows[k]["mean_phase_s"][p] for k in ks])
                     for p in PHASES])
    fig.update_layout(barmode="stack", title="Where a step's time goes (mean seconds per step, shipped adapter)",
                      yaxis_title="seconds", legend_traceorder="normal", width=760, height=520)
    fig.write_html(RESULTS / "step_breakdown.html", include_plotlyjs="cdn")
    try:
        fig.write_image(RESULTS / "step_breakdown.png")
    except Exception as exc:  # kaleido (and a browser for it) is optional
        print(f"no PNG ({exc.__class__.__name__}); the HTML has the figure")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=12, help="first N held-out tasks")
    parser.add_argument("--steps", type=int, default=3, help="steps per episode")
    parser.add_argument("--ks", default="1,4")
    parser.add_argument("--proposal", choices=PROPOSALS, default="sample", help="how K candidates differ")
    parser.add_argument("--relevance", type=float, default=DEFAULT_RELEVANCE,
                        help="weight of log P(request | tool) in the tool ranking")
    parser.add_argument("--cold-prompts", action="store_true",
                        help="forget the channel's tool lines before every task, not only before each K")
    parser.add_argument("--ahead", action="store_true",
                        help="compute each step ahead first (the Run tab's reading time), then time Step")
    parser.add_argument("--torch-step", action="store_true",
                        help="the native decode step off (writes step_latency_torch_step.json): the same-day baseline")
    parser.add_argument("--memory", action="store_true",
                        help="time each K with the rehearsal memory off and seeded (step_latency_memory.json)")
    parser.add_argument("--state", action="store_true",
                        help="time each K with the state in Rehearse prompts and without (step_latency_state.json)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the steps (writes step_profile.json only: the profiler slows them)")
    parser.add_argument("--relevance-tops", default="",
                        help="e.g. 0,8: first steps and call accuracy per channel size (step_latency_channel.json)")
    parser.add_argument("--accuracy-tasks", type=int, default=24,
                        help="--relevance-tops: first N held-out tasks for the teacher-forced call accuracy")
    args = parser.parse_args()

    import model_backend
    from model_backend import native

    native.use(not args.torch_step)

    policy = model_backend.load_policy("embedded", adapter=SHIPPED_ADAPTER)
    task_ids = envs.list_tasks("multi_turn_base", "heldout")[: args.tasks]
    if args.relevance_tops:
        channel_run(args, policy, task_ids)
        return
    store = Store(Path(tempfile.mkdtemp()) / "bench.db")
    rows: dict[str, dict] = {}
    profiles: dict[str, list[dict]] = {}
    runs: list[tuple[int, str | None, str | None]] = [(k, None, None) for k in map(int, args.ks.split(","))]
    memory = None
    if args.memory:
        from app.training.memory_seed import open_memory

        memory = open_memory(Store(Path(tempfile.mkdtemp()) / "memory.db"))
        runs = [(k, m, None) for k, _, _ in runs for m in ("off", "seed")]
    if args.state:
        runs = [(k, None, c) for k, _, _ in runs for c in ("history", "history+state")]
    for k, memory_mode, context in runs:
        settings = RunSettings(mode="parallel", branches=k, selector="logprob", seed=0, shadow=True,
                               proposal=args.proposal, relevance=args.relevance, memory=memory_mode or "off",
                               **({"rehearsal_context": context} if context else {}))
        if memory_mode is not None:  # a fresh copy each run: what one run's episodes observe stays out of the next
            run_memory = memory.detached() if memory_mode == "seed" else None
        else:
            run_memory = None
        key = f"{k}/{memory_mode}" if memory_mode else f"{k}/{context}" if context else str(k)
        runner = EpisodeRunner(envs.load_task(task_ids[0]), policy, settings, memory=run_memory)
        runner.step()  # warm-up: first-call allocations, grammar compilation, tokenizer caches
        policy.forget_scores()  # each K starts with no tool line encoded
        profile = cProfile.Profile() if args.profile else None
        totals: list[float] = []
        per_step: list[dict] = []
        first: list[float] = []  # each task's first step
        later: list[float] = []
        ahead_first: list[float] = []  # --ahead: seconds a first step took to compute ahead (the Run tab: while
        ahead_later: list[float] = []  # the person reads the picked task), and a later one (reads the last step)
        sums = {p: 0.0 for p in PHASES}
        first_sums = {p: 0.0 for p in PHASES}  # where a task's first step's time goes (the tool lines, cold prompts)
        for task_id in tqdm(task_ids, desc=f"K={k}"):
            task = envs.load_task(task_id)
            policy.reset_cache()
            # First scorings: no task reuses another's (or K=1's) results. The tool lines' KV stays from task
            # to task, as in a session that opens one task after another (--cold-prompts: it does not).
            policy.forget_scores(prompts=args.cold_prompts)
            runner = EpisodeRunner(task, policy, settings, memory=run_memory)
            recorder = Recorder(store)
            recorder.start(runner.episode)
            for i in range(args.steps):
                if args.ahead:
                    t0 = time.perf_counter()
                    assert runner.compute_ahead()
                    (ahead_later if i > 0 else ahead_first).append(time.perf_counter() - t0)
                phases, done = step_phases(runner, recorder, task, profile)
                totals.append(sum(phases.values()))
                per_step.append({"task": task_id, "step": i, "seconds": round(totals[-1], 3)})
                (later if i > 0 else first).append(totals[-1])
                for p in PHASES:
                    sums[p] += phases[p]
                    if i == 0:
                        first_sums[p] += phases[p]
                if done:
                    break
        n = len(totals)
        rows[key] = {"steps": n, "p50_s": round(statistics.median(totals), 2),
                        "mean_s": round(statistics.mean(totals), 2),
                        "p90_s": round(sorted(totals)[int(0.9 * (n - 1))], 2),
                        "mean_phase_s": {p: round(sums[p] / n, 3) for p in PHASES},
                        "first_steps_p50_s": round(statistics.median(first), 2),
                        "first_steps_mean_phase_s": {p: round(first_sums[p] / len(first), 3) for p in PHASES},
                        "later_steps_mean_phase_s": {p: round((sums[p] - first_sums[p]) / max(1, len(later)), 3)
                                                     for p in PHASES},
                        "later_steps_p50_s": round(statistics.median(later), 2), "per_step": per_step}
        if profile is not None:
            profiles[key] = top_functions(profile)
        if args.ahead:
            row = rows[key]
            row["ahead_first_p50_s"] = round(statistics.median(ahead_first), 2)
            row["ahead_later_p50_s"] = round(statistics.median(ahead_later), 2)
            row["ahead_max_s"] = round(max(ahead_first + ahead_later), 2)
            print(f"K={key}: Step waits p50 {row['p50_s']} s (max {max(totals):.2f}) once computed ahead, which took "
                  f"{row['ahead_first_p50_s']} s (p50) for a task's first step, {row['ahead_later_p50_s']} s for "
                  f"a later one")
        print(f"K={key}: p50 {rows[key]['p50_s']} s over {n} steps; " +
              ", ".join(f"{p} {v:.2f}" for p, v in rows[key]["mean_phase_s"].items()))
    if args.memory:
        for k in map(int, args.ks.split(",")):
            rows[f"{k}/seed"]["ratio_to_off"] = round(rows[f"{k}/seed"]["p50_s"] / rows[f"{k}/off"]["p50_s"], 2)
            rows[f"{k}/seed"]["paired_median_ratio_to_off"] = paired_ratio(rows[f"{k}/off"]["per_step"],
                                                                           rows[f"{k}/seed"]["per_step"])
            print(f"K={k}: p50 with memory / without {rows[f'{k}/seed']['ratio_to_off']} "
                  f"(paired median {rows[f'{k}/seed']['paired_median_ratio_to_off']})")
        write_results("step_latency_memory", {"adapter": SHIPPED_ADAPTER.name, "memory_transitions": len(memory),
                                              "memory_k": RunSettings().memory_k, "tasks": task_ids,
                                              "steps_per_task": args.steps, "results": rows})
        return
    if args.state:
        for k in map(int, args.ks.split(",")):
            with_state, without = rows[f"{k}/history+state"], rows[f"{k}/history"]
            with_state["ratio_to_history"] = round(with_state["p50_s"] / without["p50_s"], 2)
            with_state["paired_median_ratio_to_history"] = paired_ratio(without["per_step"], with_state["per_step"])
            print(f"K={k}: p50 with the state / without {with_state['ratio_to_history']} "
                  f"(paired median {with_state['paired_median_ratio_to_history']})")
        write_results("step_latency_state", {"adapter": SHIPPED_ADAPTER.name, "tasks": task_ids,
                                             "steps_per_task": args.steps, "results": rows})
        return
    if "1" in rows and "4" in rows:
        rows["4"]["ratio_to_k1"] = round(rows["4"]["p50_s"] / rows["1"]["p50_s"], 2)
        rows["4"]["paired_median_ratio"] = paired_ratio(rows["1"]["per_step"], rows["4"]["per_step"])
        goals = "" if args.ahead else " (goal <= 1.3, for the step's compute)"
        print(f"K=4 / K=1 (p50): {rows['4']['ratio_to_k1']}{goals}; K=4 p50 {rows['4']['p50_s']} s; "
              f"per (task, step) pair, median {rows['4']['paired_median_ratio']}")
    if args.profile:
        for k, top in profiles.items():
            print(f"K={k}, most time of their own: " + ", ".join(f"{f['function']} {f['share']:.0%}" for f in top[:6]))
        write_results("step_profile", {"adapter": SHIPPED_ADAPTER.name, "tasks": task_ids,
                                       "steps_per_task": args.steps, "top_functions": profiles})
        return
    if not (args.torch_step or args.ahead):
        figure(rows)
    name = "step_latency_torch_step" if args.torch_step else "step_latency_ahead" if args.ahead else "step_latency"
    write_results(name, {"computed_ahead": args.ahead, "adapter": SHIPPED_ADAPTER.name, "weights": policy.loaded.weights,
                                   "native_decode": native.status(),
                                   "mode": "parallel", "selector": "logprob", "proposal": args.proposal,
                                   "relevance": args.relevance, "cold_prompts": args.cold_prompts,
                                   "rehearsal_context": DEFAULT_REHEARSAL_CONTEXT,
                                   "tasks": task_ids, "steps_per_task": args.steps, "results": rows})


if __name__ == "__main__":
    main()
