"""Step time with and without the cross-step prefix cache, by step index (goal: >= 2x from step 3 on).

The shipped agent, parallel rehearsal K=4 (the Run tab's setting in the issue), on the first
held-out tasks. Two policies share one set of weights: one with the prefix cache, one without.
Their episodes advance in lock-step (cached step i, then uncached step i), so both see the same
machine load; greedy row 0 and seeded rows make both take the same decisions, which is checked.
"""
from __future__ import annotations

import argparse
import statistics
import time

from common import write_results
from tqdm import tqdm

from app import envs
from app.config import SHIPPED_ADAPTER
from app.engine import EpisodeRunner
from app.records import RunSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=4, help="first N held-out tasks")
    parser.add_argument("--steps", type=int, default=6, help="steps per episode")
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()

    from model_backend import load_model
    from model_backend.loading import INFERENCE_WEIGHTS
    from model_backend.policy import TransformersPolicy

    # As load_policy loads it for the product (merged, the CPU's default weights), twice wrapped.
    loaded = load_model("embedded", adapter=SHIPPED_ADAPTER, merge_adapter=True, weights=INFERENCE_WEIGHTS)
    cached, plain = TransformersPolicy(loaded), TransformersPolicy(loaded, prefix_cache_bytes=0)
    settings = RunSettings(mode="parallel", branches=args.k, selector="logprob", seed=0, shadow=True)
    by_step: dict[int, list[tuple[float, float]]] = {}
    same = True
    task_ids = envs.list_tasks("multi_turn_base", "heldout")[: args.tasks]
    for task_id in tqdm(task_ids, desc="episodes"):
        assert cached.prefix_cache is not None
        cached.reset_cache()
        runners = [EpisodeRunner(envs.load_task(task_id), p, settings) for p in (cached, plain)]
        for i in range(args.steps):
            times, steps = [], []
            for runner in runners:
                t0 = time.perf_counter()
                steps.append(runner.step())
                times.append(time.perf_counter() - t0)
            if None in steps:
                break
            a, b = steps
            same &= [x.action_text for x in a.branches] == [x.action_text for x in b.branches]
            by_step.setdefault(i, []).append((times[0], times[1]))
            if any(r.done for r in runners):
                break
    rows = {}
    for i, pairs in sorted(by_step.items()):
        c, u = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        rows[str(i)] = {"n": len(pairs), "cached_s": round(c, 2), "uncached_s": round(u, 2),
                        "speedup": round(u / c, 2)}
        print(f"step {i}: cached {c:.2f} s, uncached {u:.2f} s, {u / c:.2f}x (n={len(pairs)})")
    late = [p for i, pairs in by_step.items() if i >= 3 for p in pairs]
    late_speedup = (statistics.median(p[1] for p in late) / statistics.median(p[0] for p in late)) if late else None
    stats = cached.prefix_cache.stats
    print(f"steps >= 3: {late_speedup and round(late_speedup, 2)}x (goal >= 2); same decisions: {same}; "
          f"prompt tokens reused {stats.reused_tokens}, computed {stats.computed_tokens}")
    write_results("prefix_cache", {
        "adapter": str(SHIPPED_ADAPTER.name), "weights": INFERENCE_WEIGHTS, "k": args.k, "tasks": task_ids, "by_step": rows,
        "speedup_step3_on": late_speedup and round(late_speedup, 2), "same_decisions": same,
        "reused_tokens": stats.reused_tokens, "computed_tokens": stats.computed_tokens})


if __name__ == "__main__":
    main()
