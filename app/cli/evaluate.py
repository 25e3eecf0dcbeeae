"""CLI: `python -m app eval` (the test-time table: rehearsal modes vs the real best-of-K baseline).

Everything the user typed is checked before a model loads: a typo costs nothing.
Imports stay light: the engine, the store and the model load inside the command.
"""
from __future__ import annotations

import argparse
import sqlite3
import sys
from pathlib import Path
from typing import Any

from app.cli.common import (UserError, add_engine_options, check_selector_or_fail, is_model_failure,
                            load_policy_or_fail)
from app.config import default_db_path, resolve_adapter
from app.records import MODES

INTERRUPTED = 130


def register(sub: Any) -> None:
    p = sub.add_parser(
        "eval", help="evaluate rehearsal modes against the real best-of-K baseline",
        description="Run tasks x rows (each rehearsal mode, plus the real best-of-K baseline) through the "
                    "engine, store every episode, and write results.json, results.md and figures.html "
                    "into --out. Rerunning the same command resumes: finished episodes are read back.")
    p.add_argument("--tasks", default="bfcl:multi_turn_base",
                   help="a category (bfcl:multi_turn_base, multi_turn_miss_func, ...), an MCP server (mcp:git, "
                        "mcp:sqlite, mcp:filesystem; mcp: all), or a comma list of these and task ids")
    p.add_argument("--split", choices=("train", "heldout"), default=None,
                   help="keep one split of multi_turn_base (index mod 4 == 3 is held out)")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N tasks")
    p.add_argument("--modes", default="none,parallel,sequential", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--branches", "-k", type=int, default=4, help="K: candidates (parallel, best-of-K) or attempts "
                   "(sequential)")
    p.add_argument("--no-best-of-k", action="store_true", help="skip the real best-of-K baseline row")
    add_engine_options(p)
    p.add_argument("--max-turns", type=int, default=None, help="judge only the first N user turns of each task")
    p.add_argument("--state-probe", type=int, default=32,
                   help="calls re-rehearsed with and without the state snapshot (0: skip)")
    p.add_argument("--out", required=True, help="directory for results.json, results.md and figures.html")
    p.set_defaults(func=cmd_eval)


def _modes(text: str) -> list[str]:
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UserError(f"--modes: unknown mode(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(MODES)}")
    return modes


def _adapter(model: str, value: str | None) -> str | None:
    try:
        value = resolve_adapter(model, value)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if value is not None and not (Path(value) / "adapter_config.json").is_file():
        raise UserError(f"--adapter {value} is not a LoRA adapter directory (no adapter_config.json)")
    return value


def _check_out(out: str) -> Path:
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"--out {out} is not a writable directory ({exc.strerror or exc})") from None
    return path


def _config(args: argparse.Namespace):
    from pydantic import ValidationError

    from app.eval.evaluation import EvalConfig, resolve_tasks

    try:
        task_ids = resolve_tasks(args.tasks, args.split, args.limit)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    for name in ("max_turns", "state_probe"):
        value = getattr(args, name)
        if value is not None and value < (1 if name == "max_turns" else 0):
            raise UserError(f"--{name.replace('_', '-')} must be at least {1 if name == 'max_turns' else 0}")
    cfg = EvalConfig(task_ids=task_ids, modes=_modes(args.modes), branches=args.branches,
                     best_of_k=not args.no_best_of_k, seed=args.seed, model=args.model,
                     adapter=_adapter(args.model, args.adapter), selector=args.selector, temperature=args.temperature,
                     shadow=not args.no_shadow, rehearsal_context=args.rehearsal_context,
                     tool_choice=args.tool_choice, proposal=args.proposal, relevance=args.relevance,
                     constrain=args.constrain == "on", memory=args.memory, memory_k=args.memory_k,
                     keep_primary=args.keep_primary,
                     max_steps_per_turn=args.max_steps, max_turns=args.max_turns,
                     max_action_tokens=args.max_action_tokens, max_rehearsal_tokens=args.max_rehearsal_tokens,
                     state_probe=args.state_probe)
    try:
        cfg.row_settings()  # the same validation as `run`
    except ValidationError as exc:
        err = exc.errors()[0]
        raise UserError(f"--{'-'.join(map(str, err['loc']))}: {err['msg']}") from None
    return cfg


def _progress_bar(total: int) -> tuple[Any, Any]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc="eval", unit="episode", file=sys.stderr, dynamic_ncols=True)

    def update(event: Any) -> None:
        if event.kind == "resumed":
            bar.total -= 1  # read back, not run: keeps the ETA about the episodes still to run
        elif event.kind == "episode":
            bar.update(1)
        bar.set_postfix_str(f"{event.row} {event.task_id} step {event.steps}", refresh=True)
    return bar, update


def _load(cfg: Any) -> Any:
    """The policy, refused up front when it cannot score for the `judge` selector."""

    policy = load_policy_or_fail(cfg.model, cfg.adapter)
    check_selector_or_fail(policy, cfg.selector, "none" if set(cfg.modes) == {"none"} else "parallel")
    return policy


def cmd_eval(args: argparse.Namespace) -> int:
    import model_backend

    cfg = _config(args)
    try:
        model_backend.parse_spec(cfg.model)
    except model_backend.ModelSpecError as exc:
        raise UserError(str(exc).splitlines()[0]) from None
    out = _check_out(args.out)

    from app.eval.report import table_markdown, write_outputs
    from app.eval.evaluation import run_eval
    from app.store import Store, StoreError

    db = args.db or default_db_path()
    try:
        store = Store(db)
    except (StoreError, OSError, sqlite3.Error) as exc:
        raise UserError(f"cannot open database {db}: {exc}") from None
    bar, update = _progress_bar(len(cfg.task_ids) * len(cfg.row_settings()))
    try:
        result = run_eval(cfg, store, lambda: _load(cfg), progress=update)
    except KeyboardInterrupt:
        bar.close()
        print(f"interrupted: finished episodes are stored in {db}; run the same command again to resume",
              file=sys.stderr)
        return INTERRUPTED
    except StoreError as exc:
        raise UserError(str(exc)) from None
    except RuntimeError as exc:

        if not is_model_failure(exc):
            raise
        raise UserError(f"{str(exc).splitlines()[0]} (finished episodes are stored in {db}; run the same "
                        "command again to resume)") from None
    finally:
        bar.close()
    paths = write_outputs(result, out)
    print(table_markdown(result))
    print(f"wrote {', '.join(str(p) for p in paths)}; episodes in {db}")
    return 0
