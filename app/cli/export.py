"""CLI: `export` (TRL training rows, whole episodes, or OTLP/JSON traces) and `import` (episodes, or another
agent's chat JSONL or OTLP/JSON traces, into a database).

`export --format trl` writes the fine-tune's Act and Rehearse rows as TRL conversational
JSONL; `export --format episodes` writes stored episodes with their annotations
(`app.trace_io`), which `import` validates in full and writes in one transaction.

Imports stay light: the tokenizer (for the same token budgets as the fine-tune's prompts)
loads inside the command.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from app.cli.common import UserError
from app.config import default_db_path

ROW_SOURCES = ("corrections", "episodes", "expert")


def register(sub: Any) -> None:
    p = sub.add_parser("export", help="export training rows (TRL JSONL) or whole episodes (JSONL)",
                       description="--format trl: the joint Act and Rehearse rows that the light fine-tune trains "
                                   "on (the same prompts and targets) as TRL conversational JSONL with the "
                                   "rehearsal fields, for `trl sft` under `accelerate launch`. --format episodes: "
                                   "stored episodes with every branch and annotation, for `import` elsewhere.")
    p.add_argument("--format", choices=("trl", "episodes", "otlp"), default="trl",
                   help="trl: TRL conversational training rows; episodes: one stored episode per line (for import); "
                        "otlp: one OTLP/JSON trace per episode, the rehearsal as rehearsal.* attributes of each "
                        "tool span (for an observability backend, or `import --format otlp`)")
    p.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")
    p.add_argument("--out", required=True, help="JSONL file to write (replaced atomically)")
    p.add_argument("--rows", choices=ROW_SOURCES, default="corrections",
                   help="corrections: annotated branches, as `finetune` uses them; episodes: reward-filtered "
                        "rows of stored finished episodes (self-training); expert: ground-truth replays of tasks")
    p.add_argument("--annotated", action="store_true",
                   help="with --rows corrections: also annotated branches without a correction (their real response)")
    p.add_argument("--episodes", nargs="+", default=None, help="only these episode ids")
    p.add_argument("--tasks", default="bfcl:multi_turn_base", help="with --rows expert: a comma list of categories (multi_turn_base) or task ids")
    p.add_argument("--split", choices=("train", "heldout", "all"), default="train",
                   help="with --rows expert: the multi_turn_base split (never export held-out rows for training)")
    p.add_argument("--limit", type=int, default=None, help="with --rows expert: only the first N tasks")
    p.add_argument("--tool-format", choices=("structured", "text"), default="structured",
                   help="structured: assistant `tool_calls`, named `tool` results and `tools`; text: every "
                        "message exactly as the engine renders it")
    p.add_argument("--shape", choices=("messages", "prompt-completion"), default="messages",
                   help="messages: one conversation per row; prompt-completion: the reply apart, so TRL "
                        "trains on the reply only (as the light fine-tune does)")
    p.add_argument("--tokenizer", default="embedded",
                   help="token counts for prompt budgets: embedded | hf:<id or path> (the model you will train)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", help="import episodes (`export --format episodes`) or another agent's traces "
                                      "(--format openai | otlp)",
                       description="Validate every line of the file (size, JSON, schema, references) and write its "
                                   "episodes in one transaction: a bad file changes nothing. --format openai: chat "
                                   "JSONL ({\"messages\": [...], \"tools\": [...]} per line); --format otlp: "
                                   "OTLP/JSON spans with OpenTelemetry GenAI or OpenInference attributes "
                                   "(docs/traces.md).")
    p.add_argument("file", help="the file to import")
    p.add_argument("--format", choices=("episodes", "openai", "otlp"), default="episodes",
                   help="episodes: written by `export --format episodes` (default); openai: chat transcripts with "
                        "tool calls; otlp: OpenTelemetry spans (OTLP/JSON)")
    p.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()}; created if missing)")
    p.add_argument("--skip-existing", action="store_true",
                   help="skip episodes whose id the database already holds (default: refuse the whole file)")
    p.add_argument("--max-mb", type=float, default=None, help="size limit of the file in MiB (default 64)")
    p.set_defaults(func=cmd_import)


def _context(tokenizer_spec: str) -> Any:
    import model_backend
    from model_backend.loading import load_tokenizer

    from app.training.rows import PromptContext

    try:
        tok, window = load_tokenizer(tokenizer_spec)
    except (model_backend.ModelSpecError, model_backend.MissingModelError) as exc:
        raise UserError(f"--tokenizer: {str(exc).splitlines()[0]}") from None
    return PromptContext(lambda text: len(tok.encode(text, add_special_tokens=False)), window)


def _expert_ids(args: argparse.Namespace) -> list[str]:
    from app.eval.evaluation import resolve_tasks

    try:
        return resolve_tasks(args.tasks, None if args.split == "all" else args.split, args.limit)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _open_store(db: str | None, must_exist: bool) -> Any:
    from app.store import Store, StoreError

    db = db or default_db_path()
    if must_exist and not Path(db).is_file():
        raise UserError(f"no database at {db} (run or annotate episodes first, or pass --db)")
    try:
        return Store(db)
    except StoreError as exc:
        raise UserError(str(exc)) from None


def _export_with(write: Any, what: str, args: argparse.Namespace, out: Path) -> int:
    """Run an exporter `write(store, out, episode_ids) -> n` with the CLI's error handling; no file for no episodes."""
    from app.store import StoreError

    store = _open_store(args.db, must_exist=True)
    try:
        n = write(store, out, args.episodes)
    except StoreError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    if n == 0:
        out.unlink(missing_ok=True)
        raise UserError(f"no episodes in {store.path}")
    print(f"wrote {n} {what} to {out}")
    return 0


def cmd_export_episodes(args: argparse.Namespace, out: Path) -> int:
    from app.trace_io import export_episodes

    return _export_with(export_episodes, "episodes", args, out)


def cmd_export_otlp(args: argparse.Namespace, out: Path) -> int:
    from app.trace_io import export_otlp

    return _export_with(export_otlp, "traces (OTLP/JSON)", args, out)


def cmd_import(args: argparse.Namespace) -> int:
    from app.store import StoreError
    from app.trace_io import MAX_IMPORT_BYTES, TraceFileError, import_records, read_foreign, read_trace_file

    if args.max_mb is not None and not args.max_mb > 0:
        raise UserError("--max-mb must be more than 0")
    limit = int(args.max_mb * 2**20) if args.max_mb else MAX_IMPORT_BYTES
    try:
        # everything is checked before the database opens
        records = (read_trace_file(args.file, limit) if args.format == "episodes"
                   else read_foreign(args.file, args.format, limit))
    except TraceFileError as exc:
        raise UserError(f"{args.file}: {exc}; nothing was imported") from None
    store = _open_store(args.db, must_exist=False)
    try:
        result = import_records(store, records, skip_existing=args.skip_existing)
    except StoreError as exc:
        raise UserError(str(exc)) from None
    skipped = f"; skipped {len(result.skipped)} already present" if result.skipped else ""
    print(f"imported {len(result.imported)} episodes with {result.annotations} annotations into {store.path}{skipped}")
    for r in records:  # what a foreign trace did not record, said once per episode
        if r.episode.id in result.imported and r.episode.trace is not None and r.episode.trace.missing:
            print(f"{r.episode.id}: not recorded: {'; '.join(r.episode.trace.missing)}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from app import envs
    from app.training.finetune import FinetuneError, build_rows, select_corrections
    from app.store import StoreError
    from app.training.rows import expert_rows, self_training_rows
    from app.training.trl_export import write_jsonl

    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; name a .jsonl file")
    if args.format == "episodes":
        return cmd_export_episodes(args, out)
    if args.format == "otlp":
        return cmd_export_otlp(args, out)
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be at least 1")
    expert_ids = _expert_ids(args) if args.rows == "expert" else []
    store = _open_store(args.db, must_exist=True) if args.rows != "expert" else None
    ctx = _context(args.tokenizer)
    try:
        if args.rows == "corrections":
            selected = select_corrections(store, args.episodes, args.annotated)
            notes: list[str] = []
            rows = build_rows(store, selected, ctx, notes)
            for note in notes:  # the rest is exported
                print(f"left out: {note}", file=sys.stderr)
            episodes = {s.episode_id: store.get_episode(s.episode_id) for s in selected}
        elif args.rows == "episodes":
            ids = args.episodes or [r["id"] for r in store.list_episodes(status="finished")]
            episodes = {i: store.get_episode(i) for i in ids}
            known = {i: ep for i, ep in episodes.items() if not ep.task_id.startswith("instruction:")}
            rows = self_training_rows(known.values(), ctx)
        else:
            rows, replays = expert_rows(expert_ids, ctx)
            episodes = {ep.id: ep for ep in replays}
    except FinetuneError as exc:
        raise UserError(str(exc)) from None
    except (StoreError, KeyError, envs.UnknownTaskError) as exc:
        raise UserError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from None
    if not rows:
        raise UserError("no training rows to export (no committed call, answer or real response in the selection)")
    try:
        stats = write_jsonl(rows, episodes, out, args.tool_format, args.shape)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(f"wrote {stats.rows} rows ({stats.act} act, {stats.rehearse} rehearse) to {stats.path}")
    return 0
