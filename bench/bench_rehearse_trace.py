"""Rehearsal speed of a recorded trace (`python -m app rehearse`) on the embedded model, per recorded call.

The traces are real BFCL episodes: the ground-truth calls of the first `--tasks` held-out multi_turn_base tasks
executed in the real environment (`expert_episode`), stored in a scratch SQLite file. Each is rehearsed by the
embedded model with the shipped adapter through the product's path (`app.service.rehearsal.rehearse_episodes`,
teacher-forced, constrained decoding, 128-token predictions, surprise scored), with `--alternatives` 0 and K.
Per call: the step's seconds (`Step.duration_s`: Rehearse, plus Act and the alternatives' Rehearse at K > 0, plus
the surprise pass). For scale under the same load, live steps of the same tasks (parallel K=1: Act, Rehearse,
commit, surprise) are timed after. Writes bench/results/rehearse_trace.json.
Run: `.venv/bin/python bench/bench_rehearse_trace.py [--tasks 2] [--alternatives 2]`.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import write_results

from app import envs
from app.config import shipped_adapter
from app.engine import EpisodeRunner
from app.engine.trace_rehearsal import recorded_calls
from app.records import RunSettings
from app.service.rehearsal import rehearse_episodes
from app.store import Store
from app.training.rows import expert_episode


def figures(seconds: list[float]) -> dict:
    return {"calls": len(seconds), "p50_s": round(statistics.median(seconds), 3),
            "mean_s": round(statistics.fmean(seconds), 3), "max_s": round(max(seconds), 3),
            "calls_per_s": round(len(seconds) / sum(seconds), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2, help="held-out multi_turn_base tasks (their ground truth)")
    parser.add_argument("--alternatives", type=int, default=2, help="K of the second run (0: only the first)")
    parser.add_argument("--baseline-steps", type=int, default=3, help="live steps per task measured for scale")
    args = parser.parse_args()

    import model_backend

    adapter = shipped_adapter()
    started = time.perf_counter()
    policy = model_backend.load_policy("embedded", adapter=adapter)
    load_s = time.perf_counter() - started
    task_ids = envs.list_tasks("multi_turn_base", "heldout")[:args.tasks]
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "bench.db")
        ids = []
        for task_id in task_ids:
            ep = expert_episode(envs.load_task(task_id))
            store.replace_episode(ep)
            ids.append(ep.id)
        results = {}
        for k in sorted({0, args.alternatives}):
            result = rehearse_episodes(store, ids, policy, model="embedded", adapter=adapter, alternatives=k)
            seconds = [s.duration_s for rid in result.rehearsals for s in recorded_calls(store.get_episode(rid))]
            results[str(k)] = {**figures(seconds), "alternatives_proposed": result.alternatives}
            print(f"alternatives={k}: {len(seconds)} recorded calls, p50 {results[str(k)]['p50_s']:.2f} s per call, "
                  f"mean {results[str(k)]['mean_s']:.2f} s, {results[str(k)]['calls_per_s']:.2f} calls/s")
    # The local backend's step speed under the same load, for scale: live steps of the same tasks, parallel K=1
    # (Act, then Rehearse of the call, then the commit and the surprise pass), as the Run tab takes them.
    step_s = []
    for task_id in task_ids:
        runner = EpisodeRunner(envs.load_task(task_id), policy, RunSettings(mode="parallel", branches=1,
                                                                            selector="logprob"),
                               model="embedded", adapter=adapter)
        for _ in range(args.baseline_steps):
            step = runner.step()
            if step is None:
                break
            step_s.append(step.duration_s)
    baseline = figures(step_s) if step_s else None
    if baseline:
        print(f"baseline: live step, parallel K=1, {len(step_s)} steps, p50 {baseline['p50_s']:.2f} s")
    write_results("rehearse_trace", {"tasks": task_ids, "model": "embedded", "adapter": adapter,
                                     "max_rehearsal_tokens": 128, "policy_load_s": round(load_s, 2),
                                     "results": results, "baseline_live_step_k1": baseline})


if __name__ == "__main__":
    main()
