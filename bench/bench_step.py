"""Step latency in parallel mode for K = 1, 2, 4, 8 on the embedded model (goal: K=4 <= 1.6x K=1).

A step here is the whole decision: Act (K candidates), Rehearse (K calls, one batched
pass), judge scoring, shadow execution, commit, divergence metrics. `tool_choice=required`
makes every step a tool call so every branch is rehearsed. Each K runs the same steps of
the same task; the first step of a fresh episode is timed after one warm-up episode.
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import write_results

from app import envs
from app.engine import EpisodeRunner
from app.records import RunSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--task", default="bfcl:multi_turn_base_0")
    parser.add_argument("--steps", type=int, default=2, help="steps timed per K")
    parser.add_argument("--ks", default="1,2,4,8")
    args = parser.parse_args()

    import model_backend

    policy = model_backend.load_policy("embedded")
    task = envs.load_task(args.task)
    ks = [int(k) for k in args.ks.split(",")]

    def run(k: int) -> list[float]:
        settings = RunSettings(mode="parallel", branches=k, selector="judge", seed=0, tool_choice="required")
        runner = EpisodeRunner(task, policy, settings)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step = runner.step()
            times.append(time.perf_counter() - t0)
            if step is None:
                break
        return times

    run(1)  # warm-up: first-call allocations, tokenizer caches
    rows = {}
    for k in ks:
        times = run(k)
        rows[k] = {"mean_s": round(statistics.mean(times), 3), "steps": len(times),
                   "per_step_s": [round(t, 3) for t in times]}
        print(f"K={k}: {rows[k]['mean_s']:.2f} s/step over {len(times)} steps")
    base = rows[ks[0]]["mean_s"]
    for k in ks:
        rows[k]["ratio_to_k1"] = round(rows[k]["mean_s"] / base, 3)
    print("ratio K=4 / K=1:", rows.get(4, {}).get("ratio_to_k1"), "(goal <= 1.6)")
    write_results("step_latency", {"task": args.task, "mode": "parallel", "selector": "judge",
                                   "results": {str(k): v for k, v in rows.items()}})


if __name__ == "__main__":
    main()
