"""What every command shares: the user-error type, the engine options, and loading with one-line errors.

A `UserError` is a mistake the user can fix: `main` prints it as one line and exits with
status 2, never a traceback. Nothing here imports torch at import time.
"""
from __future__ import annotations

import argparse
from typing import Any

from app.config import DEFAULT_MODEL, DEFAULT_RELEVANCE, default_db_path
from app.records import DEFAULT_REHEARSAL_CONTEXT, MEMORY_MODES, PROPOSALS, REHEARSAL_CONTEXTS, SELECTORS, TOOL_CHOICES


class UserError(Exception):
    """A mistake the user can fix; printed as one line, exit status 2 (raise it from any command)."""


def add_engine_options(p: argparse.ArgumentParser, memory: str = "off") -> None:
    """Options shared by `run` and `eval`: selector, sampling, budgets, model, database. `memory`: the
    default of `--memory` (off: memory lowered held-out rehearsal `exact`, docs/world_model.md)."""
    p.add_argument("--selector", choices=SELECTORS, default="judge", help="how the committed branch is chosen")
    p.add_argument("--keep-primary", action=argparse.BooleanOptionalAction, default=True,
                   help="commit the greedy primary unless its rehearsal predicts an error and the selector's "
                        "choice's does not (--no-keep-primary: the selector's top score commits)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same episode")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of the alternatives")
    p.add_argument("--no-shadow", action="store_true", help="do not shadow-execute non-chosen calls on forks")
    p.add_argument("--rehearsal-context", choices=REHEARSAL_CONTEXTS, default=DEFAULT_REHEARSAL_CONTEXT,
                   help="what the Rehearse role sees besides the call: the episode's calls and results (history), "
                        "and with history+state the state before the call (default: %(default)s)")
    p.add_argument("--memory", choices=MEMORY_MODES, default=memory,
                   help="real transitions each Rehearse prompt retrieves: `seed` (replays of the training split's "
                        "ground truth and calls explored from its states), `online` (also every call observed "
                        f"since, imports and corrections), `off` (default {memory})")
    p.add_argument("--memory-k", type=int, default=3, help="retrieved transitions per Rehearse prompt (0-8)")
    p.add_argument("--tool-choice", choices=TOOL_CHOICES, default="auto",
                   help="`required`: every step calls a tool; `first`: the first step after each user message does")
    p.add_argument("--proposal", choices=PROPOSALS, default="sample",
                   help="how the K candidates differ: `tools` calls the K tools the model ranks first (greedy "
                        "arguments), `sample` samples K-1 alternatives at the temperature")
    p.add_argument("--relevance", type=float, default=DEFAULT_RELEVANCE,
                   help="weight of log P(request | tool) in the step's tool ranking (0-4); 0: the greedy action "
                        "picks the tool")
    p.add_argument("--constrain", choices=("on", "off"), default="on",
                   help="schema-constrained Act and Rehearse decoding (local models): `off` decodes freely")
    p.add_argument("--max-steps", type=int, default=None, help="step budget per user turn (default: the task's)")
    p.add_argument("--max-action-tokens", type=int, default=96, help="token budget of one Act output")
    p.add_argument("--max-rehearsal-tokens", type=int, default=128, help="token budget of one Rehearse output")
    p.add_argument("--model", default=DEFAULT_MODEL, help="embedded | hf:<id or path> | gguf:<path> | openai:<base_url>#<model> "
                        "(an OpenAI-compatible server; API key from $ENVACE_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--adapter", default=None,
                   help="LoRA adapter directory; `none` for the bare base model; `default` for the shipped "
                        "adapter (the default for `embedded`)")
    p.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")


def load_task_or_fail(task_id: str):
    from app import envs

    try:
        return envs.load_task(task_id)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def load_policy_or_fail(spec: str, adapter: str | None):
    """The policy, or a one-line UserError (bad spec, missing weights, server down or wrong model name)."""
    import model_backend

    try:
        return model_backend.load_policy(spec, adapter=adapter)
    except (model_backend.ModelSpecError, model_backend.MissingModelError, model_backend.AdapterError) as exc:
        raise UserError(str(exc).splitlines()[0]) from None
    except RuntimeError as exc:
        if is_model_failure(exc):  # RemoteError and its kinds
            raise UserError(str(exc).splitlines()[0]) from None
        raise


def check_selector_or_fail(policy: Any, selector: str, mode: str) -> None:
    """`judge` needs prompt log-probabilities: refuse it up front for a server that has none."""
    from app.engine.selection import check_selector
    from model_backend.base import RemoteCapabilityError

    try:
        check_selector(policy, selector, mode)
    except RemoteCapabilityError as exc:
        raise UserError(str(exc)) from None


def is_model_failure(exc: BaseException) -> bool:
    """A remote server's failure (RemoteError kinds, RemoteCapabilityError), not a bug of ours."""
    import model_backend

    return isinstance(exc, (model_backend.RemoteCapabilityError, model_backend.RemoteError))
