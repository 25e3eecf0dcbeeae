"""Fine-tune throughput: 20 corrected steps x 3 epochs on the embedded model (goal: at most 3 minutes).

The corrected steps come from expert traces of BFCL training tasks stored in a temporary
database; each correction replaces the real response of one call (`corrected_predicted`),
the common case of a rehearsal that diverged from reality. One optimizer step is one row,
so 3 epochs are 60 steps. Wall time covers the whole `run_finetune` (model load, before
and after metrics, training, atomic save, registry).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import write_results

from app import envs
from app.training.finetune import FinetuneRequest, run_finetune
from app.records import Annotation
from app.store import Store
from app.training.rows import expert_episode


def corrected_store(path: Path, n: int) -> Store:
    store = Store(path)
    done = 0
    for task_id in envs.list_tasks("multi_turn_base", "train"):
        ep = expert_episode(envs.load_task(task_id))
        store.save_episode(ep)
        for step in ep.steps:
            store.add_step(ep, step)
        for row in store.branch_rows(ep.id):
            if row["kind"] == "call" and done < n:
                # A plausible correction: the real response, with a note field the model must learn.
                store.add_annotation(Annotation(branch_id=row["id"], label="minor",
                                                corrected_predicted={"corrected": True, "step": row["step_idx"]}))
                done += 1
        if done >= n:
            return store
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="corrected steps")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--parent", default="default", help="adapter to continue (`none`: base weights)")
    args = parser.parse_args()

    from app.training.agent import default_adapter_path

    parent = None if args.parent == "none" else (default_adapter_path() if args.parent == "default" else Path(args.parent))
    with tempfile.TemporaryDirectory() as tmp:
        store = corrected_store(Path(tmp) / "bench.db", args.steps)
        started = time.perf_counter()
        result = run_finetune(store, FinetuneRequest(out=Path(tmp) / "adapter", steps=args.steps * args.epochs,
                                                     parent=parent, measure_agreement=False))
        wall = time.perf_counter() - started
    train = result.metrics["train"]
    print(f"{train['steps']} steps: {train['tokens_per_s']} tokens/s, training {train['seconds']} s, "
          f"wall {wall:.1f} s (goal <= 180 s); loss {train['loss_first']} -> {train['loss_last']}")
    write_results("finetune", {
        "corrected_steps": args.steps, "epochs": args.epochs, "parent": str(parent) if parent else None,
        "wall_s": round(wall, 1), "goal_s": 180, "train": train,
        "rehearse_nll_before": result.metrics["before"].get("rehearse_nll"),
        "rehearse_nll_after": result.metrics["after"].get("rehearse_nll"),
    })


if __name__ == "__main__":
    main()
