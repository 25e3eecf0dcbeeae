"""A simulated annotator: correct N diverged rehearsals of a few tools, fine-tune as the tab does, measure unseen calls.

1. Divergences: the ground truth of BFCL `multi_turn_base` training-split tasks (index mod 4 != 3), replayed in the
   real classes (`expert_episode`), each call rehearsed by the shipped adapter with its real history and the
   default rehearsal context (greedy, constrained, as `forced_rehearsal` does). The tools with the most diverged rehearsals (exact false) are the
   corrected tools; N of their diverged calls are stored as annotated branches whose correction is the real
   response (what a careful annotator would type).
2. The fine-tune: `app.service.finetune.build_request` + `run_finetune`, the Fine-tune tab's own path, with the
   tab's defaults (replay ratio, checkpoints, unseen calls) unless overridden.
3. The figures: Rehearse exact (and NLL) before and after on unseen calls (the held-out split, index mod 4 == 3)
   of the corrected tools and of the other tools (`unseen_probe`), the checkpoint curve and the default decision.

Goal (issue 36): +0.15 exact on the corrected tools' unseen calls, at most -0.02 on the others, the fine-tune in
under 3 minutes on 2 cores for N = 20. Writes bench/results/corrections.json (`--name` to change).

Run: `.venv/bin/python bench/bench_corrections.py --n 20`.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, write_results

sys.path.insert(0, str(ROOT))

from app import envs  # noqa: E402
from app.config import shipped_adapter  # noqa: E402
from app.divergence import compare  # noqa: E402
from app.formats import REHEARSE_STOP, parse_result  # noqa: E402
from app.records import Annotation  # noqa: E402
from app.store import Store  # noqa: E402
from app.service import finetune as finetune_service  # noqa: E402
from app.training.finetune import CORRECTED, OTHERS, run_finetune  # noqa: E402
from app.engine.replay import replay  # noqa: E402
from app.training.rows import expert_episode  # noqa: E402
from app.ui import constants as C  # noqa: E402


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def rehearse_training_calls(policy, n_tasks: int, seed: int, batch: int = 8) -> list[dict]:
    """Forced rehearsal of every ground-truth call of `n_tasks` seeded training tasks: one dict per call."""
    from model_backend.base import GenerationConfig

    ids = envs.list_tasks("multi_turn_base", "train")
    random.Random(seed).shuffle(ids)
    items, prompts = [], []
    for task_id in ids[:n_tasks]:
        task = envs.load_task(task_id)
        episode = expert_episode(task)
        for view in replay(episode, task):
            b = view.step.chosen_branch
            if b.kind == "call" and b.call is not None:
                prompts.append(view.rehearse_prompt(b.call, episode.settings.rehearsal_context, constrain=True))
                items.append({"task": task_id, "episode": episode, "step": view.step.index, "tool": b.call.name,
                              "actual": b.actual})
    config = GenerationConfig(max_new_tokens=128, temperature=0.0, stop=REHEARSE_STOP)
    started = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for gen, item in zip(policy.rehearse(prompts[i:i + batch], config), items[i:i + batch]):
            predicted, error = parse_result(gen.text)
            item["exact"] = bool(compare(predicted, error is None, item["actual"]).exact)
        print(f"rehearsed {min(i + batch, len(prompts))}/{len(prompts)} training calls "
              f"({time.perf_counter() - started:.0f} s, load {load_average()[0]})", file=sys.stderr, flush=True)
    return items


def corrected_store(path: Path, items: list[dict], n: int, n_tools: int) -> tuple[Store, list[str], list[dict]]:
    """N diverged calls of the `n_tools` tools with the most divergences, stored and corrected with the real
    response; returns the store, the tools and the corrected calls."""
    diverged = [it for it in items if not it["exact"]]
    counts = collections.Counter(it["tool"] for it in diverged)
    tools = [t for t, _ in counts.most_common(n_tools)]
    chosen = [it for it in diverged if it["tool"] in tools][:n]
    store = Store(path)
    saved: set[str] = set()
    for it in chosen:
        ep = it["episode"]
        if ep.id not in saved:
            store.save_episode(ep)
            for step in ep.steps:
                store.add_step(ep, step)
            saved.add(ep.id)
        branch = next(r for r in store.branch_rows(ep.id) if r["step_idx"] == it["step"] and r["idx"] == 0)
        store.add_annotation(Annotation(branch_id=branch["id"], label="major", corrected_predicted=it["actual"],
                                        corrected_predicted_set=True, note="simulated annotator: the real response"))
    return store, tools, [{k: v for k, v in it.items() if k != "episode"} for it in chosen]


def main() -> None:
    d = C.FT_DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=20, help="corrections")
    p.add_argument("--tools", type=int, default=3, help="corrected tools (those with the most divergences)")
    p.add_argument("--tasks", type=int, default=40, help="training tasks rehearsed to find divergences")
    p.add_argument("--steps", type=int, default=d["steps"], help="most steps (the tab's default)")
    p.add_argument("--lr", type=float, default=d["lr"])
    p.add_argument("--replay-ratio", type=float, default=d["replay_ratio"])
    p.add_argument("--eval-every", type=int, default=d["eval_every"])
    p.add_argument("--unseen", type=int, default=d["unseen_rows"], help="unseen calls per group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="corrections", help="results file under bench/results/")
    args = p.parse_args()

    import torch

    from model_backend import load_policy

    adapter = shipped_adapter()
    out: dict = {"adapter": adapter, "args": vars(args), "torch_threads": torch.get_num_threads(),
                 "cpus": os.cpu_count(), "load_average_start": load_average()}
    started = time.perf_counter()
    policy = load_policy("embedded", adapter=adapter)
    items = rehearse_training_calls(policy, args.tasks, args.seed)
    out["divergence_search"] = {"calls": len(items), "diverged": sum(not it["exact"] for it in items),
                                "seconds": round(time.perf_counter() - started, 1),
                                "by_tool": dict(collections.Counter(it["tool"] for it in items if not it["exact"]))}
    print(json.dumps(out["divergence_search"]), flush=True)
    write_results(args.name, {**out, "finished": False})  # a long run keeps what it measured
    del policy
    with tempfile.TemporaryDirectory() as tmp:
        store, tools, chosen = corrected_store(Path(tmp) / "bench.db", items, args.n, args.tools)
        out["corrected_tools"], out["corrections"] = tools, len(chosen)
        req = finetune_service.build_request(episodes=None, annotated=False, steps=args.steps, lr=args.lr, rank=d["rank"],
                                    parent=adapter, out=Path(tmp) / "child", heldout_rows=0, agreement=False,
                                    max_steps=C.FT_MAX_STEPS, unseen_rows=args.unseen,
                                    replay_ratio=args.replay_ratio, eval_every=args.eval_every)
        req.seed = args.seed
        out["load_average_before_finetune"] = load_average()
        t0 = time.perf_counter()
        result = run_finetune(store, req)
        out["finetune_wall_s"] = round(time.perf_counter() - t0, 1)
    m = result.metrics
    out["load_average_end"] = load_average()
    out["train"] = m["train"]
    out["train_and_checkpoints_s"] = m["seconds"]
    out["rows"] = result.data["rows"]
    out["checkpoints"] = {k: v for k, v in (m.get("checkpoints") or {}).items() if k != "validation"}
    unseen = m.get("unseen") or {}
    groups = unseen.get("groups") or {}
    out["unseen"] = {g: {k: v for k, v in groups[g].items() if k != "rows"} for g in (CORRECTED, OTHERS) if g in groups}
    out["by_tool"] = unseen.get("by_tool")
    out["verdict"] = m.get("verdict")
    out["default"] = m.get("default")

    def delta(g: str) -> float | None:
        v = out["unseen"].get(g)
        if not v or not v["n"]:
            return None
        return round(v["after"]["rehearse_exact"] - v["before"]["rehearse_exact"], 4)

    out["delta_exact"] = {CORRECTED: delta(CORRECTED), OTHERS: delta(OTHERS)}
    out["goal"] = {"corrected_delta_min": 0.15, "others_delta_min": -0.02, "finetune_s_max": 180,
                   "met": bool(delta(CORRECTED) is not None and delta(CORRECTED) >= 0.15 and delta(OTHERS) is not None
                               and delta(OTHERS) >= -0.02 and out["finetune_wall_s"] <= 180)}
    out["total_s"] = round(time.perf_counter() - started, 1)
    out["finished"] = True
    write_results(args.name, out)
    print(out["verdict"])
    print(json.dumps({"delta_exact": out["delta_exact"], "finetune_wall_s": out["finetune_wall_s"],
                      "checkpoints": out["checkpoints"].get("checkpoints"), "best_step": out["checkpoints"].get("best_step"),
                      "stopped": out["checkpoints"].get("stopped_early"), "default": out["default"],
                      "load": [out["load_average_start"], out["load_average_end"]], "goal": out["goal"]}, indent=1))


if __name__ == "__main__":
    main()
