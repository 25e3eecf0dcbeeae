"""What the Fine-tune tab asks of `app.training.finetune`, without Gradio: the form, the data preview, the job.

The fine-tune itself (validation, training, atomic save, registration) is the library's
`run_finetune`; here are the UI's translations around it: raw form values -> a
`FinetuneRequest` (or an `InputError` naming the field), a preview of the rows the
selected corrections give (no model: prompts are only counted approximately, which
changes no row), and a job that runs the fine-tune in a worker thread and hands its
progress to the UI through a queue. One job at a time in the process: training takes
every core, and a second one would only slow both.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from app.config import shipped_adapter
from app.training.finetune import (MAX_HELDOUT_ROWS, MAX_REPLAY_RATIO, MAX_UNSEEN_ROWS, FinetuneError, FinetuneRequest, FinetuneResult,
                                   Selected, build_rows, run_finetune, select_corrections)
from app.service import InputError, parse_number
from app.store import Store
from app.training.rows import PromptContext

log = logging.getLogger(__name__)

ADAPTER_ROOT = Path("runs") / "adapters"
"""Where the UI writes new adapters (git-ignored); each fine-tune gets `ADAPTER_ROOT/<name>`."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
PREVIEW_CONTEXT = 1 << 20
"""The preview's context window: large, so no history is cut; cutting changes prompts, never the row count."""


class FinetuneBusyError(InputError):
    """A fine-tune is already running in this process."""


# ---------------------------------------------------------------- the form


def default_name() -> str:
    return f"ft-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"


def adapter_dir(name: str | None, root: Path = ADAPTER_ROOT) -> Path:
    """`root/<name>` for a new adapter, or an InputError when the name is unusable or taken."""
    name = (name or "").strip()
    if not NAME.fullmatch(name):
        raise InputError(f"Adapter name {name!r} is not usable: use 1-80 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit (it becomes a directory name).")
    out = Path(root) / name
    if out.exists() or out.is_symlink():  # a link, even a dangling one, would write elsewhere
        raise InputError(f"{out} already exists: choose another adapter name.")
    return out


def build_request(*, episodes: list[str] | None, annotated: bool, steps: Any, lr: Any, rank: Any,
                  parent: str | None, out: Path, heldout_rows: Any, agreement: bool,
                  max_steps: int, unseen_rows: Any = 0, replay_ratio: Any = 0, eval_every: Any = 0) -> FinetuneRequest:
    """A FinetuneRequest from raw form values; an InputError names the field and its range.

    `parent` is an adapter directory or None (the base weights); the library checks that it
    is an adapter, and that `out` is new, before anything loads.
    """
    steps = int(parse_number("Steps", steps, 1, max_steps, whole=True))
    lr = parse_number("Learning rate", lr, 0, 1.0, whole=False)
    if lr == 0:
        raise InputError("Learning rate must be above 0 (and at most 1), e.g. 3e-4; got 0.")
    rank = int(parse_number("Rank", rank, 1, 256, whole=True))
    held = int(parse_number("Held-out rows", heldout_rows, 0, MAX_HELDOUT_ROWS, whole=True))
    unseen = int(parse_number("Unseen calls per group", unseen_rows, 0, MAX_UNSEEN_ROWS, whole=True))
    replay = parse_number("Replay ratio", replay_ratio, 0, MAX_REPLAY_RATIO, whole=False)
    every = int(parse_number("Evaluate every N steps", eval_every, 0, max_steps, whole=True))
    return FinetuneRequest(out=out, steps=steps, lr=lr, rank=rank, parent=Path(parent) if parent else None,
                           episodes=list(episodes) if episodes else None, annotated=bool(annotated),
                           measure_agreement=bool(agreement), heldout_rows=held, unseen_rows=unseen,
                           replay_ratio=float(replay), eval_every=every)


def parent_path(choice: str | None, shipped_label: str, none_label: str) -> str | None:
    """The parent adapter directory of a parent choice (None: the base weights)."""
    if choice in (None, "", none_label):
        return None
    if choice == shipped_label:
        shipped = shipped_adapter()
        if shipped is None:
            raise InputError("There is no shipped adapter in fixtures/adapters (run `make train-agent`): "
                             "pick the base weights or a registered adapter as the parent.")
        return shipped
    return choice


# ---------------------------------------------------------------- the data


@dataclass
class PlannedBranch:
    """One selected branch and the rows it gives."""

    selected: Selected
    act_rows: int = 0
    rehearse_rows: int = 0

    @property
    def correction(self) -> str:
        ann = self.selected.annotation
        parts = (["action"] if (ann.corrected_action or "").strip() else []) + \
                (["response"] if ann.corrected_predicted_set else [])
        return " + ".join(parts) or "real response"


@dataclass
class Plan:
    branches: list[PlannedBranch] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    """What cannot become a row and is left out (the rest trains), one line each."""

    @property
    def act_rows(self) -> int:
        return sum(b.act_rows for b in self.branches)

    @property
    def rehearse_rows(self) -> int:
        return sum(b.rehearse_rows for b in self.branches)


def plan(store: Store, episodes: list[str] | None, annotated: bool) -> Plan:
    """The branches a fine-tune with these filters would use and their Act/Rehearse rows.

    The same selection and row building as `run_finetune`, with an approximate token count
    instead of the model's tokenizer: so no model loads, and a bad correction fails here.
    """
    selected = select_corrections(store, episodes or None, annotated)
    notes: list[str] = []
    rows = build_rows(store, selected, PromptContext(lambda text: len(text) // 4 + 1, PREVIEW_CONTEXT), notes)
    by_annotation = {s.annotation_id: PlannedBranch(s) for s in selected}
    for row in rows:
        planned = by_annotation[int(row.ref.rsplit("#annotation", 1)[1])]
        if row.role == "act":
            planned.act_rows += 1
        else:
            planned.rehearse_rows += 1
    return Plan(list(by_annotation.values()), notes)


# ---------------------------------------------------------------- the job

_RUNNING = threading.Lock()
"""Held while a fine-tune runs in this process (every session shares it)."""


@dataclass
class JobEvent:
    """What the worker reports: a training step, the result, or a failure (exactly one is set)."""

    progress: Any = None
    result: FinetuneResult | None = None
    error: str | None = None


class FinetuneJob:
    """`run_finetune` in a worker thread; `events()` hands its progress to the caller's thread."""

    def __init__(self, store: Store, req: FinetuneRequest) -> None:
        self.store, self.req = store, req
        self._events: queue.Queue[JobEvent] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="finetune", daemon=True)

    def _work(self) -> None:
        last = JobEvent(error="the fine-tune stopped without a result")
        try:
            last = JobEvent(result=run_finetune(self.store, self.req,
                                                progress=lambda p: self._events.put(JobEvent(progress=p))))
        except FinetuneError as exc:
            last = JobEvent(error=str(exc))
        except Exception as exc:  # a model or storage failure: the library left everything as it was
            log.exception("fine-tune to %s failed", self.req.out)
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            last = JobEvent(error=f"{type(exc).__name__}: {first_line}")
        finally:
            _RUNNING.release()  # before the last event: whoever reads it may start the next fine-tune
            self._events.put(last)

    def events(self, poll_s: float) -> Iterator[JobEvent | None]:
        """Events as they come, and None every `poll_s` without one (time to refresh a clock); ends
        after the result or the error."""
        while True:
            try:
                event = self._events.get(timeout=poll_s)
            except queue.Empty:
                if not self.thread.is_alive() and self._events.empty():  # killed without a word
                    yield JobEvent(error="the fine-tune stopped without a result")
                    return
                yield None
                continue
            yield event
            if event.progress is None:
                return


def start(store: Store, req: FinetuneRequest) -> FinetuneJob:
    """Start a fine-tune, or raise FinetuneBusyError when one is running (nothing is started then)."""
    if not _RUNNING.acquire(blocking=False):
        raise FinetuneBusyError("A fine-tune is already running (one at a time: training uses every core). "
                                "Wait for it to finish, then press Fine-tune again.")
    job = FinetuneJob(store, req)
    try:
        job.thread.start()
    except BaseException:
        _RUNNING.release()
        raise
    return job


def is_running() -> bool:
    return _RUNNING.locked()


__all__ = ["ADAPTER_ROOT", "FinetuneBusyError", "FinetuneJob", "JobEvent", "Plan", "PlannedBranch", "adapter_dir",
           "build_request", "default_name", "is_running", "parent_path", "plan", "start"]
