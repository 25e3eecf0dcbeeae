"""Does the world model foresee the errors of its own agent's calls? Forced rehearsal cannot tell: ground-truth calls
almost never fail. This rolls out held-out tasks as the model card does (`rollout_settings`: parallel K=2, logprob
selector, tools ranked, shadow execution) and counts, over every rehearsed branch with a real response (committed or
shadow): exact predictions, real errors, real errors the rehearsal predicted (an `error` key in both), and false
alarms (a predicted error where the call succeeded). It also counts the episodes' plain answers, and on question
turns (the turn's own read-only calls returned data) the answers that carry that data.

Each `--runs` entry is `name=adapter_dir@context` (context `history` or `history+state`); the first held-out
`multi_turn_base` tasks, first `--turns` turns. Writes bench/results/error_foresight.json (`--name` to change).

Run: `.venv/bin/python bench/bench_error_foresight.py` (about 3 minutes a run on 2 cores).
"""
from __future__ import annotations

import argparse
import sys
import time

from common import ROOT, write_results

sys.path.insert(0, str(ROOT))

from app import envs  # noqa: E402
from app.training.agent import SHIPPED_ADAPTER, rollout_settings, run_episode  # noqa: E402
from app.training.rows import mentions, turn_ends  # noqa: E402
from model_backend import load_policy  # noqa: E402

CANDIDATE = ROOT / "fixtures" / "adapters" / "candidates" / "envace-smollm2-135m-state"
DEFAULT_RUNS = (f"shipped={SHIPPED_ADAPTER}@history,candidate={CANDIDATE}@history,"
                f"candidate+state={CANDIDATE}@history+state")


def turn_answers(episode) -> list[dict]:
    """Each plain answer of the episode, and whether it carries the data its turn's own read-only calls returned
    (`rows.answer_values`: a question turn when there is any)."""
    out = []
    for view, values in turn_ends(episode, envs.load_task(episode.task_id)):
        text = view.step.chosen_branch.action_text
        out.append({"task": episode.task_id, "turn": view.step.turn, "text": text, "question": bool(values),
                    "mentions": bool(values) and mentions(text, values)})
    return out


def is_error(value: object) -> bool:
    return isinstance(value, dict) and "error" in value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=DEFAULT_RUNS, help="name=adapter_dir@context, comma-separated")
    p.add_argument("--tasks", type=int, default=8, help="first N held-out multi_turn_base tasks")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--name", default="error_foresight")
    args = p.parse_args()

    task_ids = envs.list_tasks("multi_turn_base", "heldout")[:args.tasks]
    out: dict = {"tasks": task_ids, "turns": args.turns, "settings": rollout_settings().model_dump(), "runs": {}}
    for run in args.runs.split(","):
        name, _, rest = run.partition("=")
        adapter, _, context = rest.rpartition("@")
        policy = load_policy("embedded", adapter=adapter)
        settings = rollout_settings().model_copy(update={"rehearsal_context": context})
        started = time.perf_counter()
        branches, answers = [], []
        for task_id in task_ids:
            episode = run_episode(task_id, policy, settings, args.turns)
            answers += turn_answers(episode)
            for step in episode.steps:
                for b in step.branches:
                    if b.kind == "call" and b.call is not None and b.actual_source is not None:
                        branches.append({"task": task_id, "step": step.index, "tool": b.call.name,
                                         "arguments": b.call.arguments, "predicted": b.predicted,
                                         "actual": b.actual, "source": b.actual_source,
                                         "exact": bool(b.metrics and b.metrics.exact)})
        errors = [b for b in branches if is_error(b["actual"])]
        result = {"adapter": str(adapter), "context": context, "branches": len(branches),
                  "exact": sum(b["exact"] for b in branches), "real_errors": len(errors),
                  "foreseen": sum(is_error(b["predicted"]) for b in errors),
                  "false_alarms": sum(is_error(b["predicted"]) and not is_error(b["actual"]) for b in branches),
                  "answers": len(answers), "question_turns": sum(a["question"] for a in answers),
                  "answers_with_data": sum(a["mentions"] for a in answers),
                  "seconds": round(time.perf_counter() - started, 1), "details": branches, "answer_details": answers}
        out["runs"][name] = result
        print(name, {k: v for k, v in result.items() if not k.endswith("details")}, flush=True)
        write_results(args.name, out)  # after every run: a long run keeps what it measured
        del policy


if __name__ == "__main__":
    main()
