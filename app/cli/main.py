"""Command line: `python -m app tasks | run | serve`, plus the subcommands of `train`, `evaluate`, `export`.

Each command opens resources, calls one library function, formats the result. User
errors become one line on stderr and exit status 2, never a traceback. Heavy imports
(torch, transformers) happen inside commands so `--help` is instant.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Callable

from app.cli import annotate, evaluate, export, rehearse, train
from app.cli.common import (UserError, add_engine_options, check_selector_or_fail, is_model_failure,
                            load_policy_or_fail, load_task_or_fail)
from app.config import DEFAULT_TASK, default_db_path, resolve_adapter
from app.records import MODES

log = logging.getLogger("app")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=MODES, default="parallel", help="test-time rehearsal mode")
    p.add_argument("--branches", "-k", type=int, default=4, help="K: candidates (parallel) or attempts (sequential)")
    add_engine_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app", description="EnvACE Inspector: run and inspect "
                                     "tool-using agents that rehearse their tool calls.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("tasks", help="list task ids", description="List task ids.")
    p.add_argument("--category", default=None, help="e.g. multi_turn_base, multi_turn_miss_param; "
                   "for tau2 the domain: airline, retail, telecom")
    p.add_argument("--split", choices=("train", "heldout"), default=None,
                   help="the multi_turn_base split; for tau2, tau2's train or test split (default: its base split)")
    p.add_argument("--suite", default="bfcl", help="bfcl (default), tau2, mcp (--category: an MCP server, e.g. git) or mock")
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser("run", help="run one episode step by step",
                       description="Run one episode of a task and store it in SQLite.")
    p.add_argument("--task", default=DEFAULT_TASK, help="task id, e.g. bfcl:multi_turn_base_0")
    _add_run_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the step-by-step account")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("serve", help="start the web inspector", description="Start the Gradio app.")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind")
    p.add_argument("--port", type=int, default=7860, help="port")
    p.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")
    p.add_argument("--mcp", action="store_true",
                   help="also serve the world model as an MCP server (tools `rehearse` and `propose`) at "
                        "/gradio_api/mcp/ (streamable HTTP)")
    p.set_defaults(func=cmd_serve)

    for module in (train, evaluate, export, annotate, rehearse):  # subcommands owned by their own modules
        module.register(sub)
    return parser


# ------------------------------------------------------------------ commands


def cmd_tasks(args: argparse.Namespace) -> int:
    from app import envs

    try:
        ids = envs.list_tasks(args.category, args.split, suite=args.suite)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    print("\n".join(ids))
    return 0


def settings_from_args(args: argparse.Namespace):
    from pydantic import ValidationError

    from app.records import RunSettings

    try:
        return RunSettings(mode=args.mode, branches=1 if args.mode == "none" else args.branches,
                           selector=args.selector, seed=args.seed, temperature=args.temperature,
                           shadow=not args.no_shadow, rehearsal_context=args.rehearsal_context,
                           tool_choice=args.tool_choice, proposal=args.proposal, relevance=args.relevance,
                           constrain=args.constrain == "on", memory=args.memory, memory_k=args.memory_k,
                           keep_primary=args.keep_primary,
                           max_steps_per_turn=args.max_steps,
                           max_action_tokens=args.max_action_tokens,
                           max_rehearsal_tokens=args.max_rehearsal_tokens)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise UserError(f"--{'-'.join(map(str, err['loc']))}: {err['msg']}") from None


def cmd_run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    task = load_task_or_fail(args.task)  # before the model: a typo costs nothing
    try:
        args.adapter = resolve_adapter(args.model, args.adapter)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    policy = load_policy_or_fail(args.model, args.adapter)
    check_selector_or_fail(policy, settings.selector, settings.mode)

    from app.engine import EpisodeRunner, end_reason_text, episode_json, format_step
    from app.store import Recorder, Store, StoreError

    db_path = args.db or default_db_path()
    try:
        store = Store(db_path)
    except StoreError as exc:
        raise UserError(str(exc)) from None
    from app.training.memory_seed import open_memory

    recorder = Recorder(store)
    runner = EpisodeRunner(task, policy, settings, model=args.model, adapter=args.adapter, on_step=recorder,
                           memory=open_memory(store) if settings.memory != "off" else None)
    recorder.start(runner.episode)
    out = sys.stderr if args.json else sys.stdout
    print(f"Episode {runner.episode.id}: {task.id} | model {args.model} | adapter {args.adapter or 'none'} "
          f"| mode {settings.mode} "
          f"K={settings.branches} selector {settings.selector} seed {settings.seed}", file=out)
    last_turn = -1
    try:
        for step in runner.run():
            if step.turn != last_turn:
                last_turn = step.turn
                user = " ".join(m["content"] for m in task.turns[step.turn]) or "(no new message)"
                print(f"Turn {step.turn + 1}: {user[:200]}", file=out)
            print(format_step(step), file=out, flush=True)
            if runner.turn > step.turn:
                t = runner.episode.turn_results[-1]
                print(f" turn {t.turn + 1}: {'success' if t.success else 'failure'} "
                      f"(state {'ok' if t.state_ok else 'differs'}, response {'ok' if t.response_ok else 'missing'})",
                      file=out)
    except KeyboardInterrupt:
        runner.stop()
    except RuntimeError as exc:
        if not is_model_failure(exc):
            raise
        # The server went away mid-step: the finished steps are already stored; say so and stop.
        runner.fail(str(exc).splitlines()[0])
        ep = runner.episode
        try:
            recorder.flush(ep)
        except StoreError:
            pass
        raise UserError(f"{ep.error} (episode {ep.id} marked failed; {len(ep.steps)} complete step(s) "
                        f"saved to {db_path})") from None
    try:
        recorder.flush(runner.episode)
    except StoreError as exc:
        raise UserError(f"{exc} ({len(recorder.pending)} step(s) not saved)") from None
    ep = runner.episode
    print(f"Episode {ep.id}: success={ep.success} external_calls={ep.external_calls} "
          f"shadow_calls={ep.shadow_calls} rehearsals={ep.rehearsals} (saved to {db_path})", file=out)
    print(f"Ended: {end_reason_text(ep)}", file=out)
    if args.json:
        print(json.dumps(episode_json(ep), ensure_ascii=False, default=str))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from app.ui import build_demo, close_demo
    from app.ui import constants as C

    demo = build_demo(db_path=args.db or default_db_path(), mcp=args.mcp)
    stop = shutdown_event()  # before launch: a SIGTERM as soon as the port answers is heard too
    demo.queue(default_concurrency_limit=2).launch(server_name=args.host, server_port=args.port,
                                                   max_file_size=f"{C.MAX_IMPORT_MB}mb", prevent_thread_lock=True,
                                                   mcp_server=args.mcp)
    wait_for(stop)
    close_demo(demo)
    return 0


def shutdown_event() -> Any:
    """An event set by SIGTERM or Ctrl+C (Gradio's own blocking loop lets SIGTERM pass unheard)."""
    import signal
    import threading

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def wait_for(stop: Any) -> None:
    while not stop.wait(0.5):  # a timed wait: signal handlers run between waits
        pass
    print("shutting down", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


