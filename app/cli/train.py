"""CLI: `train-agent` (build the shipped adapter) and `finetune` (light fine-tune on corrections).

Imports stay light: torch, peft and the training modules load inside the commands.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from app.cli.common import UserError
from app.config import default_db_path


def register(sub: Any) -> None:
    from app.training.agent import HELDOUT_ROWS as HELDOUT_COLUMNS, AgentTrainingConfig

    d = AgentTrainingConfig()  # one set of defaults: the dataclass's
    p = sub.add_parser("train-agent", help="train the shipped agent adapter (~35 min on 2 cores)",
                       description="Expert traces of the BFCL multi_turn_base training split -> joint "
                                   "Act+Rehearse LoRA training -> one reward-filtered self-training round "
                                   "-> adapter and model card in fixtures/adapters/.")
    p.add_argument("--out", default=None, help="adapter directory (default: the shipped fixtures path)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for sampling and training")
    p.add_argument("--train-tasks", type=int, default=None, help="use only the first N training tasks")
    p.add_argument("--round1-minutes", type=float, default=d.round1_minutes, help="time budget of expert training")
    p.add_argument("--rollout-minutes", type=float, default=d.rollout_minutes,
                   help="time budget of self-training rollouts")
    p.add_argument("--round2-minutes", type=float, default=d.round2_minutes,
                   help="time budget of each self-training round")
    p.add_argument("--self-rounds", type=int, default=d.self_rounds, help="reward-filtered self-training rounds")
    p.add_argument("--round1-steps", type=int, default=d.round1_steps, help="step cap of expert training")
    p.add_argument("--rehearse-rows", type=int, default=d.rehearse_rows,
                   help="expert Rehearse rows in round 1 (0: all 852)")
    p.add_argument("--single-turn-rows", type=int, default=d.single_turn_rows,
                   help="Act rows from BFCL single-turn tool selection (multiple, live_multiple) in round 1 (-1: all)")
    p.add_argument("--rehearse-categories", default=",".join(d.rehearse_categories),
                   help="BFCL categories whose training split gives Rehearse rows (comma-separated)")
    p.add_argument("--act-rows", type=int, default=None, help="sample this many expert Act rows (default: all)")
    p.add_argument("--act-tasks", type=int, default=None,
                   help="instead of --act-rows: every Act row of this many sampled training tasks (each turn's "
                        "calls and answer pack into shared sequences)")
    p.add_argument("--memory-k", type=int, default=d.memory_k,
                   help="real transitions retrieved into each Rehearse row's prompt (0: none)")
    p.add_argument("--memory-share", type=float, default=d.memory_share,
                   help="with --memory-k: the share of Rehearse rows given memory")
    p.add_argument("--state-share", type=float, default=d.state_share,
                   help="the share of Rehearse rows whose prompt shows the state before the call "
                        "(rehearsal context history+state), the rest the history alone (default: as recorded)")
    p.add_argument("--explore", type=int, default=d.explore,
                   help="calls explored on forks before each expert call, Rehearse rows of their real responses "
                        "(errors included; 0: none)")
    p.add_argument("--explore-rows", type=int, default=d.explore_rows,
                   help="with --explore: the explored Rehearse rows used in round 1 (default: all)")
    p.add_argument("--rollout-tasks", type=int, default=d.rollout_tasks, help="training tasks rolled out per round")
    p.add_argument("--parent", default=None,
                   help="continue this adapter directory (a warm start) instead of a new LoRA")
    p.add_argument("--eval-tasks", type=int, default=d.eval_tasks,
                   help="held-out tasks for the base-vs-adapter table (0: skip)")
    p.add_argument("--eval-turns", type=int, default=d.eval_turns, help="turns rolled out per held-out task")
    p.add_argument("--eval-minutes", type=float, default=d.eval_minutes,
                   help="wall-time cap of each model's held-out episodes (0: none, every task runs)")
    p.add_argument("--evaluate", metavar="ADAPTER", default=None,
                   help="train nothing: add the held-out base-vs-adapter table to this train-agent adapter's card")
    p.add_argument("--previous", metavar="ADAPTER", default=None,
                   help="with --evaluate: an earlier adapter to add to the table (constrained and not)")
    p.add_argument("--eval-columns", default=None, metavar="COLUMNS",
                   help="with --evaluate: measure only these comma-separated columns of the held-out table "
                        f"({', '.join(HELDOUT_COLUMNS)}) and keep the card's others")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (minutes), not the shipped adapter")
    p.set_defaults(func=cmd_train_agent)

    p = sub.add_parser("finetune", help="fine-tune an adapter on corrected branches",
                       description="Light LoRA fine-tune on annotated/corrected branches of a database; "
                                   "registers the new adapter (parent, data, before/after metrics).")
    p.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")
    p.add_argument("--annotated", action="store_true",
                   help="also use annotated branches without a correction (their real response)")
    p.add_argument("--episodes", nargs="+", default=None, help="only corrections in these episode ids")
    p.add_argument("--steps", type=int, required=True,
                   help="optimizer steps (1-10000); with --eval-every, the most (it may stop early)")
    p.add_argument("--lr", type=float, default=3e-4, help="learning rate")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of a new adapter")
    p.add_argument("--parent", default="default",
                   help="adapter to continue: a directory, `default` (the shipped one) or `none` (base weights)")
    p.add_argument("--out", required=True, help="new adapter directory (must not exist)")
    p.add_argument("--model", default="embedded", help="base model spec")
    p.add_argument("--no-agreement", action="store_true", help="skip the before/after Act generation")
    p.add_argument("--unseen", type=int, default=0,
                   help="measure Rehearse exact and NLL before and after on N real calls never trained on, of the "
                        "corrected tools and of the other tools each (held-out expert replays; 0: skip); the child "
                        "becomes the default adapter only when measured and not worse on the other tools")
    from app.training.finetune import EVAL_EVERY, REPLAY_RATIO, WORSE_BY

    p.add_argument("--replay-ratio", type=float, default=REPLAY_RATIO,
                   help="replay rows per correction row: a seeded sample of the shipped adapter's own training rows "
                        f"(BFCL training split), against forgetting (0: corrections only; default {REPLAY_RATIO:g})")
    p.add_argument("--eval-every", type=int, default=EVAL_EVERY,
                   help="checkpoint every N steps (and after the last) on training-split validation calls: stop "
                        "early when the corrected tools stop improving or the other tools get worse, keep the best "
                        "checkpoint, the parent's weights included "
                        f"(0: no checkpoints; default {EVAL_EVERY})")
    p.add_argument("--worse-by", type=float, default=WORSE_BY,
                   help="the child is not made the default when its Rehearse exact on the other tools' unseen calls "
                        f"falls by more than this (default {WORSE_BY})")
    p.add_argument("--seed", type=int, default=0, help="seed of the replay sample, the probes and training")
    p.set_defaults(func=cmd_finetune)


def _bar(total: int, desc: str) -> tuple[Any, Callable[[Any], None]]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="step", file=sys.stderr)

    def update(p: Any) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{p.loss:.3f}")
    return bar, update


def cmd_train_agent(args: argparse.Namespace) -> int:
    from app.envs.bfcl_tasks import CATEGORIES
    from app.training.agent import SHIPPED_ADAPTER, AgentTrainingConfig, train_agent

    cfg = AgentTrainingConfig(out=Path(args.out) if args.out else SHIPPED_ADAPTER, seed=args.seed,
                              train_tasks=args.train_tasks, round1_minutes=args.round1_minutes,
                              rollout_minutes=args.rollout_minutes, round2_minutes=args.round2_minutes,
                              eval_tasks=args.eval_tasks, eval_turns=args.eval_turns,
                              eval_minutes=args.eval_minutes, self_rounds=args.self_rounds,
                              round1_steps=args.round1_steps, rehearse_rows=args.rehearse_rows or None,
                              rollout_tasks=args.rollout_tasks, single_turn_rows=args.single_turn_rows,
                              parent=Path(args.parent) if args.parent else None,
                              rehearse_categories=tuple(c.strip() for c in args.rehearse_categories.split(",")
                                                        if c.strip()),
                              act_rows=args.act_rows, act_tasks=args.act_tasks, memory_k=args.memory_k,
                              memory_share=args.memory_share,
                              state_share=args.state_share, explore=args.explore,
                              explore_rows=args.explore_rows)
    if args.self_rounds < 0 or args.rollout_tasks < 1 or args.round1_steps < 1:
        raise UserError("--self-rounds must be 0 or more; --rollout-tasks and --round1-steps at least 1")
    unknown = [c for c in cfg.rehearse_categories if c not in CATEGORIES]
    if unknown or not cfg.rehearse_categories:
        raise UserError(f"--rehearse-categories: unknown {', '.join(unknown) or '(none given)'}; "
                        f"valid: {', '.join(CATEGORIES)}")
    if args.act_tasks is not None and args.act_tasks < 1:
        raise UserError("--act-tasks must be at least 1")
    if not 0 <= args.explore <= 4 or (args.explore_rows is not None and args.explore_rows < 0):
        raise UserError("--explore must be 0-4 and --explore-rows 0 or more")
    if not 0 <= args.memory_k <= 8 or not 0 <= args.memory_share <= 1 or not 0 <= (args.state_share or 0) <= 1:
        raise UserError("--memory-k must be 0-8, --memory-share and --state-share 0-1")
    if args.parent and not (Path(args.parent) / "adapter_config.json").is_file():
        raise UserError(f"--parent {args.parent} is not a LoRA adapter directory")
    for name in ("eval_tasks", "eval_turns"):
        if getattr(args, name) < 0 or (name == "eval_turns" and args.eval_turns == 0):
            raise UserError(f"--{name.replace('_', '-')} must be {'at least 1' if name == 'eval_turns' else '0 or more'}")
    if args.eval_minutes < 0:
        raise UserError("--eval-minutes must be 0 (no cap) or more")
    if args.evaluate:
        columns = {c.strip() for c in args.eval_columns.split(",") if c.strip()} if args.eval_columns else None
        return _evaluate(Path(args.evaluate), cfg, Path(args.previous) if args.previous else None, columns)
    if args.quick:
        if not args.out:
            raise UserError("--quick needs --out (it must not replace the shipped adapter)")
        cfg.train_tasks, cfg.rehearse_rows, cfg.round1_steps, cfg.rollout_tasks = 4, 4, 3, 1
        cfg.rollout_turns, cfg.round2_steps, cfg.expert_replay_rows = 1, 2, 2
        cfg.eval_tasks, cfg.eval_turns, cfg.eval_forced_calls = min(cfg.eval_tasks, 1), 1, 4
    bars: list[Any] = []

    def factory(name: str, steps: int) -> Callable[[Any], None]:
        for bar in bars:
            bar.close()
        bar, update = _bar(steps, name)
        bars.append(bar)
        return update

    card = train_agent(cfg, report=lambda line: print(line, file=sys.stderr, flush=True), progress_factory=factory)
    for bar in bars:
        bar.close()
    print(f"adapter written to {cfg.out} (model card: {cfg.out / 'README.md'}); "
          f"{card['total_seconds'] / 60:.1f} min")
    return 0


def _evaluate(adapter: Path, cfg: Any, previous: Path | None = None, columns: set[str] | None = None) -> int:
    from app.training.agent import HELDOUT_ROWS as HELDOUT_COLUMNS, evaluate_adapter

    if not (adapter / "training.json").is_file():
        raise UserError(f"{adapter} is not an adapter written by train-agent (no training.json)")
    if cfg.eval_tasks == 0:
        raise UserError("--evaluate needs --eval-tasks of at least 1")
    if previous is not None and not (previous / "adapter_config.json").is_file():
        raise UserError(f"--previous {previous} is not a LoRA adapter directory")
    if columns is not None and not columns <= set(HELDOUT_COLUMNS):
        raise UserError(f"--eval-columns: unknown column(s) {', '.join(sorted(columns - set(HELDOUT_COLUMNS)))}; "
                        f"choose from {', '.join(HELDOUT_COLUMNS)}")
    started = time.perf_counter()
    try:
        evaluate_adapter(adapter, cfg, report=lambda line: print(line, file=sys.stderr, flush=True),
                         previous=previous, columns=columns)
    except ValueError as exc:  # a card measured on another protocol
        raise UserError(f"--eval-columns: {exc}") from None
    what = f"column(s) {', '.join(sorted(columns))}" if columns else "table"
    print(f"held-out {what} added to {adapter / 'README.md'}; {(time.perf_counter() - started) / 60:.1f} min")
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from app.training.finetune import (FinetuneError, FinetuneRequest, checkpoint_summary, run_finetune,
                                       validate_request)
    from app.store import Store, StoreError

    if args.parent == "none":
        parent = None
    elif args.parent == "default":
        from app.training.agent import default_adapter_path

        parent = default_adapter_path()
    else:
        parent = Path(args.parent)
    req = FinetuneRequest(out=Path(args.out), steps=args.steps, lr=args.lr, rank=args.rank, parent=parent,
                          episodes=args.episodes, annotated=args.annotated, spec=args.model,
                          measure_agreement=not args.no_agreement, unseen_rows=args.unseen,
                          replay_ratio=args.replay_ratio, eval_every=args.eval_every,
                          worse_by=args.worse_by, seed=args.seed)
    db = args.db or default_db_path()
    try:
        validate_request(req)  # before opening anything: a typo costs nothing
        if db != ":memory:" and not Path(db).is_file():
            raise UserError(f"database {db} does not exist")
        store = Store(db)
    except FinetuneError as exc:
        raise UserError(str(exc)) from None
    except StoreError as exc:
        raise UserError(str(exc)) from None
    bar, update = _bar(req.steps, "fine-tune")
    try:
        result = run_finetune(store, req, progress=update)
    except (FinetuneError, StoreError) as exc:
        raise UserError(str(exc)) from None
    finally:
        bar.close()
    m = result.metrics
    print(f"adapter {result.adapter_id} written to {result.path} (parent {result.parent or 'base weights'}); "
          f"run {result.run_id}")
    print(json.dumps({"trained_on": {"before": _brief(m["before"]), "after": _brief(m["after"])}, "train": m["train"]}))
    if m.get("verdict"):
        print(m["verdict"])
    if m.get("checkpoints"):
        print(checkpoint_summary(m["checkpoints"]))
    print(f"adapter {result.adapter_id}: {m['default']['reason']}")
    return 0


def _brief(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if not k.endswith("_rows")}
