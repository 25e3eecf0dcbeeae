"""The world model's proof: forced rehearsal of every ground-truth call of held-out tasks, with and without the
rehearsal memory (`app.engine.memory`), for one adapter.

Each config rehearses the same calls with their real history (`app.training.agent.forced_rehearsal`):
- `off`: no memory (the Rehearse prompt as before the memory);
- `seed`: the memory seeded from the training split (BFCL's four categories, index mod 4 != 3), never the
  evaluated task's own transitions except its earlier ground-truth calls (observed earlier in the episode);
- `seed@N`: a random N of the seed's transitions (the memory-size curve);
- `episode`: an empty memory, so a prompt sees only the task's earlier ground-truth calls (what an episode
  has observed itself before this call);
- any of them with `+state` (`off+state`): each prompt also shows the state before the call, the tool's own
  class's (`rehearsal_context="history+state"`, `app.formats.state_section`).

Writes bench/results/world_model.json (figures; `--details` adds one row per call to a separate file) and, with
`--curve`, bench/results/world_model_curve.html (plotly: exact against the number of transitions).

Run: `.venv/bin/python bench/bench_world_model.py --configs off,seed` (290 calls per config on
`multi_turn_base`: about 20 minutes each on 2 cores). `--categories` takes the other BFCL multi-turn categories
and tau2 domains (`tau2:airline`; their held-out split) too.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, write_results

sys.path.insert(0, str(ROOT))

from app import envs  # noqa: E402
from app.config import shipped_adapter  # noqa: E402
from app.engine.memory import RehearsalMemory  # noqa: E402
from app.store import Store  # noqa: E402
from app.training.agent import forced_rehearsal  # noqa: E402
from app.training.memory_seed import open_memory  # noqa: E402
from model_backend import load_policy  # noqa: E402


def sized(memory: RehearsalMemory, n: int, seed: int = 0) -> RehearsalMemory:
    held = memory.transitions()
    return RehearsalMemory(None, random.Random(seed).sample(held, min(n, len(held))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapter", default=None, help="adapter directory (default: the shipped one)")
    p.add_argument("--categories", default="multi_turn_base",
                   help="BFCL categories and tau2 domains (tau2:airline, tau2:retail), comma-separated")
    p.add_argument("--tasks", type=int, default=None, help="first N held-out tasks per category (default: all)")
    p.add_argument("--calls", type=int, default=None, help="at most N calls per category")
    p.add_argument("--configs", default="off,seed", help="off, seed, seed@N, episode, each optionally +state "
                   "(comma-separated)")
    p.add_argument("--k", type=int, default=3, help="transitions per prompt")
    p.add_argument("--name", default="world_model", help="results file name under bench/results/")
    p.add_argument("--details", default=None, help="also write per-call rows to this JSON file")
    p.add_argument("--curve", action="store_true", help="draw exact against memory size (needs seed@N configs)")
    args = p.parse_args()

    adapter = Path(args.adapter) if args.adapter else shipped_adapter()
    policy = load_policy("embedded", adapter=adapter)
    seed, seed_seconds = RehearsalMemory(None, []), 0.0
    if any(not c.startswith(("off", "episode")) for c in args.configs.split(",")):  # only memory configs need it
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            seed = open_memory(Store(Path(tmp) / "memory.db"))
            seed_seconds = round(time.perf_counter() - started, 1)
        print(f"seed memory: {len(seed)} transitions ({seed.counts()}) in {seed_seconds} s", flush=True)
    out: dict = {"adapter": str(adapter), "k": args.k, "seed_transitions": len(seed), "seed_seconds": seed_seconds,
                 "results": {}}
    details: dict = {}
    for category in args.categories.split(","):
        suite, _, domain = category.rpartition(":")  # tau2:airline -> the tau2 suite's airline domain
        task_ids = envs.list_tasks(domain, "heldout", suite=suite or "bfcl")[:args.tasks]
        for config in args.configs.split(","):
            name, _, extra = config.partition("+")
            memory = (None if name == "off" else seed if name == "seed" else RehearsalMemory(None, [])
                      if name == "episode" else sized(seed, int(name.split("@")[1])))
            context = "history+state" if extra == "state" else "history"
            rows: list = []
            started = time.perf_counter()
            result = forced_rehearsal(policy, task_ids, args.calls, memory=memory, memory_k=args.k, details=rows,
                                      rehearsal_context=context)
            result["seconds"] = round(time.perf_counter() - started, 1)
            result["tasks"] = len(task_ids)
            out["results"].setdefault(category, {})[config] = result
            details.setdefault(category, {})[config] = rows
            print(category, config, json.dumps({k: result[k] for k in ("n", "exact", "field_f1", "error_agree",
                                                                      "json_valid", "looping", "seconds")}),
                  json.dumps(result["by_access"]), flush=True)
            write_results(args.name, out)  # after every config: a long run keeps what it measured
            if args.details:
                Path(args.details).write_text(json.dumps(details, indent=1, default=str))
    if args.curve:
        import plotly.graph_objects as go

        fig = go.Figure()
        for category, configs in out["results"].items():
            points = sorted((0 if c == "off" else len(seed) if c == "seed" else int(c.split("@")[1]), r["exact"])
                            for c, r in configs.items() if c != "episode" and "+" not in c)
            fig.add_scatter(x=[max(x, 1) for x, _ in points], y=[y for _, y in points], mode="lines+markers",
                            name=category)
        fig.update_layout(title="Forced rehearsal exact match against transitions in memory",
                          xaxis_title="transitions in memory (log; 0 drawn at 1)", yaxis_title="exact",
                          xaxis_type="log", yaxis_range=[0, 1])
        path = RESULTS / f"{args.name}_curve.html"
        fig.write_html(path, include_plotlyjs="cdn")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
