"""Does parallel rehearsal do no harm? Held-out turns passed with no rehearsal against parallel rehearsal, per
BFCL multi-turn category and per selector, with and without the keep-primary rule (issue 35 part 6).

For each category: the first `--tasks` held-out tasks (index mod 4 == 3 in every category, never trained on),
the first `--turns` user turns, seed `--seed`, the shipped adapter on the product's defaults (constrained
decoding, tool ranking, rehearsal context, K=4 sampled candidates) through `app.eval.evaluation.run_eval`, the
same code as `python -m app eval`. Rows: `none` (K=1, no rehearsal) and `parallel` under each `--selectors`
entry (`judge`, `logprob`, `memory`; `+keep` adds the rule `RunSettings.keep_primary`: the commit leaves the
greedy primary only when the primary's rehearsal predicts an error and the chosen branch's does not).

Counted per row: turns passed, call accuracy, steps, and for parallel rows the commits that left the primary and
how many of those moves the judge's turn verdicts favoured. Writes bench/results/selection.json (`--name`).

Run: `.venv/bin/python bench/bench_selection.py` (about 4 minutes a category and selector on 2 quiet cores).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, write_results

sys.path.insert(0, str(ROOT))

from app import envs  # noqa: E402
from app.config import SHIPPED_ADAPTER  # noqa: E402
from app.eval.evaluation import EvalConfig, run_eval, truncate  # noqa: E402
from app.store import Store  # noqa: E402
from model_backend import load_policy  # noqa: E402


def counts(store: Store, episode_ids: list[str], max_turns: int) -> dict[str, int]:
    """Turns judged and passed, steps, and the committed steps whose chosen branch is not the primary (branch 0)
    with the turns they fell in and how many of those passed."""
    judged = passed = steps = moves = turns_with_move = passed_with_move = 0
    for episode_id in episode_ids:
        ep = truncate(store.get_episode(episode_id), max_turns)
        verdict = {t.turn: t.success for t in ep.turn_results}
        judged += len(verdict)
        passed += sum(verdict.values())
        turns = {s.turn for s in ep.steps if s.chosen != 0 and s.turn in verdict}
        steps += len(ep.steps)
        moves += sum(s.chosen != 0 for s in ep.steps)
        turns_with_move += len(turns)
        passed_with_move += sum(verdict[t] for t in turns)
    return {"turns_passed": passed, "turns": judged, "steps": steps, "moved_off_primary": moves,
            "turns_with_a_move": turns_with_move, "of_them_passed": passed_with_move}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--categories", default=",".join(envs.CATEGORIES))
    p.add_argument("--tasks", type=int, default=6, help="first N held-out tasks per category")
    p.add_argument("--turns", type=int, default=2, help="judge the first N user turns")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--selectors", default="judge+keep,judge,logprob+keep",
                   help="parallel rows: selector, +keep for the keep-primary rule")
    p.add_argument("--adapter", default=str(SHIPPED_ADAPTER))
    p.add_argument("--name", default="selection")
    args = p.parse_args()

    policy = load_policy("embedded", adapter=args.adapter)
    out: dict = {"adapter": args.adapter, "tasks_per_category": args.tasks, "turns": args.turns,
                 "seed": args.seed, "branches": args.branches, "categories": {}}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "selection.db")
        for category in args.categories.split(","):
            task_ids = envs.list_tasks(category, "heldout")[:args.tasks]
            rows: dict[str, dict] = {}
            configs = [("none", "judge", True, ["none"])] + [
                (f"parallel/{s}", s.split("+")[0], s.endswith("+keep"), ["parallel"])
                for s in args.selectors.split(",")]
            for name, selector, keep, modes in configs:
                cfg = EvalConfig(task_ids=task_ids, modes=modes, branches=args.branches, best_of_k=False,
                                 seed=args.seed, adapter=args.adapter, selector=selector, keep_primary=keep,
                                 max_turns=args.turns, state_probe=0)
                started = time.perf_counter()
                result = run_eval(cfg, store, policy)
                row = result["rows"][0]
                rows[name] = {**counts(store, row["episodes"], args.turns), "call_accuracy": row["call_accuracy"],
                              "rehearsal_exact": row.get("exact"), "seconds": round(time.perf_counter() - started, 1)}
                print(f"{category} {name}: {rows[name]['turns_passed']}/{rows[name]['turns']} turns, call accuracy "
                      f"{row['call_accuracy']}, moved {rows[name]['moved_off_primary']} "
                      f"({rows[name]['seconds']} s)", flush=True)
            out["categories"][category] = {"tasks": task_ids, "rows": rows}
            write_results(args.name, out)  # after every category: a long run keeps what it measured
        store.close()


if __name__ == "__main__":
    main()
