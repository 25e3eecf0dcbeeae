"""Do the agent's final answers report what the turn found? At each turn's end of held-out `multi_turn_base` tasks,
after the turn's ground-truth calls and their real results (every model sees the same history), the Act role writes
its reply (`app.training.agent.forced_answers`, greedy, schema-constrained as in the app). Counted: replies that are
answers rather than another call, replies that are the old fixed "Done: I have completed your request.", and on
question turns (the turn's read-only calls returned data) replies that carry that data.

Each `--runs` entry is `name=adapter_dir`. Writes bench/results/answers.json (`--name` to change), every reply in
`details`.

Run: `.venv/bin/python bench/bench_answers.py` (about 2 minutes a run of 24 tasks on 2 cores).
"""
from __future__ import annotations

import argparse
import sys
import time

from common import ROOT, write_results

sys.path.insert(0, str(ROOT))

from app import envs  # noqa: E402
from app.training.agent import SHIPPED_ADAPTER, forced_answers  # noqa: E402
from model_backend import load_policy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=f"shipped={SHIPPED_ADAPTER}", help="name=adapter_dir, comma-separated")
    p.add_argument("--tasks", type=int, default=24, help="first N held-out multi_turn_base tasks")
    p.add_argument("--name", default="answers")
    args = p.parse_args()

    task_ids = envs.list_tasks("multi_turn_base", "heldout")[:args.tasks]
    out: dict = {"tasks": task_ids, "runs": {}}
    for run in args.runs.split(","):
        name, _, adapter = run.partition("=")
        policy = load_policy("embedded", adapter=adapter)
        started = time.perf_counter()
        details: list[dict] = []
        result = forced_answers(policy, task_ids, details=details)
        out["runs"][name] = {"adapter": adapter, **result, "seconds": round(time.perf_counter() - started, 1),
                             "details": details}
        print(name, result, flush=True)
        write_results(args.name, out)  # after every run: a long run keeps what it measured
        del policy


if __name__ == "__main__":
    main()
