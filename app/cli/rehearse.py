"""CLI: `rehearse` (a world model predicts every recorded call of stored episodes, teacher-forced) and `compare`
(world models side by side on the same rehearsed episodes, per tool). The service does the work
(`app.service.rehearsal`, `app.service.model_comparison`); bad input is one line and writes nothing."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from app.cli.common import UserError, load_policy_or_fail
from app.config import DEFAULT_MODEL, default_db_path, resolve_adapter


def register(sub: Any) -> None:
    p = sub.add_parser("rehearse", help="rehearse stored episodes' recorded calls with a world model",
                       description="For each recorded call of the episodes, the model predicts the response from "
                                   "the recorded history (teacher-forced); predicted versus actual is stored as a "
                                   "new episode linked to its source (the same model again replaces it).")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--episodes", help="episode ids, separated by commas")
    which.add_argument("--all", action="store_true", help="every stored episode that is not itself a rehearsal")
    p.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded | hf:<id or path> | gguf:<path> | "
                   "openai:<base_url>#<model>")
    p.add_argument("--adapter", default=None, help="LoRA adapter directory; `none` for the bare base model; "
                   "`default` for the shipped adapter (the default for `embedded`)")
    p.add_argument("--alternatives", type=int, default=0,
                   help="K: also propose K calls at each recorded call (the greedy one, then sampled), rehearsed "
                        "but never executed (0-8, default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled alternatives")
    p.add_argument("--max-rehearsal-tokens", type=int, default=128, help="token budget of one prediction")
    p.add_argument("--replace-annotated", action="store_true",
                   help="rehearse again even where this model's earlier rehearsal carries annotations (deleted)")
    p.set_defaults(func=cmd_rehearse)

    p = sub.add_parser("compare", help="compare world models on the same rehearsed episodes",
                       description="exact, field_f1 and error_agree per tool and per model over the episodes' "
                                   "rehearsals, and the calls where the models predicted differently.")
    p.add_argument("--episodes", required=True, help="source episode ids, separated by commas")
    p.add_argument("--models", required=True,
                   help="SPEC[@ADAPTER],SPEC...: e.g. embedded,embedded@none,embedded@adapters/child")
    p.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_compare)


def _store(db: str | None):
    from app.store import Store, StoreError

    path = db or default_db_path()
    if not Path(path).is_file():
        raise UserError(f"no database at {path} (run or import episodes first, or pass --db)")
    try:
        return Store(path)
    except StoreError as exc:
        raise UserError(str(exc)) from None


def cmd_rehearse(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from app.service.forms import InputError
    from app.service.rehearsal import (check_sources, parse_episode_ids, rehearsable_ids, rehearse_episodes,
                                       split_rehearsable, summary)
    from app.store import StoreError

    store = _store(args.db)
    try:
        adapter = resolve_adapter(args.model, args.adapter)
        if not 0 <= args.alternatives <= 8:
            raise InputError(f"--alternatives must be 0 to 8; got {args.alternatives}")
        ids = parse_episode_ids(args.episodes) if not args.all else []
        if args.all:  # every episode that can be rehearsed; the others are named and skipped
            ids, skipped = split_rehearsable(store, rehearsable_ids(store), args.model, adapter, args.replace_annotated)
            for line in skipped:
                print(f"skipped: {line}", file=sys.stderr)
            if not ids:
                raise InputError(f"no episode to rehearse in {store.path}")
        check_sources(store, ids, args.model, adapter, args.replace_annotated)  # before the model: a typo costs nothing
    except (ValueError, InputError) as exc:
        raise UserError(str(exc)) from None
    policy = load_policy_or_fail(args.model, adapter)
    bar = tqdm(total=0, desc="rehearse", unit="call", file=sys.stderr, dynamic_ncols=True)

    def progress(done: int, total: int, what: str) -> None:
        bar.total = total
        bar.n = done
        bar.set_postfix_str(what, refresh=True)

    try:
        result = rehearse_episodes(store, ids, policy, model=args.model, adapter=adapter,
                                   alternatives=args.alternatives, replace_annotated=args.replace_annotated,
                                   remember=store.add_transitions, progress=progress, seed=args.seed,
                                   max_rehearsal_tokens=args.max_rehearsal_tokens)
    except (InputError, StoreError, ValueError) as exc:
        raise UserError(str(exc).splitlines()[0]) from None
    finally:
        bar.close()
    print(summary(result))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from app.service.forms import InputError
    from app.service.model_comparison import TABLE_COLUMNS, compare_models, parse_models, table_rows
    from app.service.rehearsal import parse_episode_ids

    store = _store(args.db)
    try:
        comparison = compare_models(store, parse_episode_ids(args.episodes), parse_models(args.models))
    except InputError as exc:
        raise UserError(str(exc)) from None
    if args.json:
        print(json.dumps(comparison.as_json(), ensure_ascii=False, default=str))
        return 0
    rows = [TABLE_COLUMNS] + [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r] for r in table_rows(comparison)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_COLUMNS))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    print(f"\n{comparison.calls} recorded call(s); the models predicted differently at {len(comparison.disagreements)}:")
    for d in comparison.disagreements:
        print(f"  {d.key}: {d.call}")
        for label, b in d.branches.items():
            shown = json.dumps(b.predicted, ensure_ascii=False) if b.metrics.json_valid else f"(invalid) {b.predicted_text}"
            print(f"    {label}: {shown[:160]}  exact={b.metrics.exact} field_f1={b.metrics.field_f1}")
    return 0
