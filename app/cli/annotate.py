"""CLI: `annotate` (label or correct one stored branch), through the same checks as the Annotate tab.

A corrected response is one JSON document (`null`, `""`, `0` and `false` are corrections); a corrected action is a
call of a tool of the branch's step with schema-valid arguments, or a plain answer with `--answer`. A correction is
checked in full before anything is written; a corrected response of a call joins the rehearsal memory at once.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from app.cli.common import UserError
from app.config import default_db_path


def register(sub: Any) -> None:
    p = sub.add_parser("annotate", help="label or correct one stored branch",
                       description="Annotate the branch at --episode/--step/--branch: a label, a corrected response "
                                   "(JSON), a corrected action (a tool call, or a plain answer with --answer), a "
                                   "note. The same checks as the Annotate tab; nothing is written on an error.")
    p.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")
    p.add_argument("--episode", required=True, help="episode id")
    p.add_argument("--step", type=int, required=True, help="step index (0-based)")
    p.add_argument("--branch", type=int, default=None, help="branch index in the step (default: the committed one)")
    p.add_argument("--label", default=None, help="match, minor, major, hallucinated_state or wrong_format")
    p.add_argument("--response", default=None,
                   help='the corrected response as JSON, e.g. \'{"error": "..."}\' or null')
    p.add_argument("--action", default=None,
                   help='the corrected action: <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
    p.add_argument("--answer", action="store_true", help="the corrected action is a plain answer, not a tool call")
    p.add_argument("--note", default="", help="a note")
    p.add_argument("--annotator", required=True, help="your name")
    p.set_defaults(func=cmd_annotate)


def cmd_annotate(args: argparse.Namespace) -> int:
    from app.service.annotations import save_annotation
    from app.service.forms import InputError
    from app.store import Store, StoreError

    db = args.db or default_db_path()
    if not Path(db).is_file():
        raise UserError(f"no database at {db} (run episodes first, or pass --db)")
    try:
        store = Store(db)
        branch_id = store.branch_id_at(args.episode, args.step, args.branch)
        result = save_annotation(store, branch_id, args.label, args.response or "", args.action or "", args.note,
                                 args.annotator, answer=args.answer, remember=store.add_transitions)
    except (InputError, StoreError) as exc:
        said = str(exc).replace('tick "plain answer"', "pass --answer")  # the tab's wording, in the CLI's terms
        raise UserError(f"{said} Nothing was saved.") from None
    line = f"saved annotation {result.id} on branch {branch_id} (episode {args.episode}, step {args.step})"
    if result.remembered is not None:
        line += f"; its corrected response of {result.remembered.tool} joined the rehearsal memory"
    print(line)
    return 0
