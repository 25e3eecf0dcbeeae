"""What the Fine-tune tab asks of `app.training.finetune`, without Gradio: the form, the data preview, the job,
and the tab's figures (the live loss curve, the before/after table and figure).

The fine-tune itself (validation, training, atomic save, registration) is the library's
`run_finetune`; here are the UI's translations around it: raw form values -> a
`FinetuneRequest` (or an `InputError` naming the field), a preview of the rows the
selected corrections give (no model: prompts are only counted approximately, which
changes no row), and a job that runs the fine-tune in a worker thread and hands its
progress to the UI through a queue. One job at a time in the process: training takes
every core, and a second one would only slow both.

The tab's figures live here too (one module per concern of `app.service`, its figures included, as the
Dashboard's are `dashboard.py`'s and the model comparison's `model_comparison.py`'s): pure functions of the
library's numbers (`FinetuneResult.losses`, `.metrics`) in the Dashboard's style (`LAYOUT`, `empty_figure`); an
empty input gives a figure that says so, never an exception.
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

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.config import shipped_adapter
from app.training.finetune import (MAX_HELDOUT_ROWS, MAX_REPLAY_RATIO, MAX_UNSEEN_ROWS, WORSE_BY, FinetuneError,
                                   FinetuneRequest, FinetuneResult, Selected, build_rows, checkpoint_summary,
                                   run_finetune, select_corrections, validate_request)
from app.service.dashboard import LAYOUT, empty_figure
from app.service.forms import InputError, parse_number
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


# ---------------------------------------------------------------- figures

METRICS: tuple[tuple[str, str, bool], ...] = (
    ("rehearse_nll", "Rehearse NLL", True),
    ("rehearse_exact", "Rehearse exact", False),
    ("act_nll", "Act NLL", True),
    ("act_agreement", "Act agreement", False),
)
"""(key in the library's metrics, label, lower is better)."""
COMPARISON_COLUMNS = ["Examples", "Metric", "Before", "After", "Change"]
COLORS = {"before": "#9aa5b1", "after": "#2f6fde"}


def loss_figure(losses: list[float], steps: int | None = None) -> go.Figure:
    """Loss of each optimizer step; the x axis spans the whole run so the curve shows progress."""
    title = "Training loss"
    if not losses:
        return empty_figure(title, "The loss appears here once training starts (the model loads first).")
    fig = go.Figure()
    fig.add_scatter(x=list(range(1, len(losses) + 1)), y=losses, mode="lines+markers", name="loss",
                    hovertemplate="step %{x}: %{y:.4f}<extra></extra>")
    xaxis: dict[str, Any] = {"title": "step"}
    if steps:
        xaxis["range"] = [0.5, max(steps, len(losses)) + 0.5]
    fig.update_layout(title=title, xaxis=xaxis, yaxis={"title": "loss"}, showlegend=False, **LAYOUT)
    return fig


def _sets(metrics: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    # The corrections' own rows are what the fine-tune trained on: named so, never read as "fixed".
    sets = [("trained on (the corrections)", metrics.get("before") or {}, metrics.get("after") or {})]
    held = metrics.get("heldout")
    if held:
        sets.append((f"held-out ({len(held.get('rows', []))} rows)", held.get("before") or {},
                     held.get("after") or {}))
    unseen = metrics.get("unseen") or {}
    for tool, v in (unseen.get("by_tool") or {}).items():
        sets.append((f"unseen {tool} calls (n={v['n']})", v.get("before") or {}, v.get("after") or {}))
    others = (unseen.get("groups") or {}).get("other tools")
    if others and others.get("n"):
        sets.append((f"unseen other tools (n={others['n']})", others.get("before") or {}, others.get("after") or {}))
    return sets


def comparison_rows(metrics: dict[str, Any]) -> list[list[Any]]:
    """One row per (examples, metric) that was measured: before, after, and the change."""
    rows = []
    for name, before, after in _sets(metrics):
        for key, label, lower_better in METRICS:
            if before.get(key) is None or after.get(key) is None:
                continue
            delta = after[key] - before[key]
            verdict = "same" if abs(delta) < 1e-9 else ("better" if (delta < 0) == lower_better else "worse")
            rows.append([name, label, before[key], after[key], f"{delta:+.4f} ({verdict})"])
    return rows


def comparison_figure(metrics: dict[str, Any]) -> go.Figure:
    """Grouped before/after bars, one panel above the other (their titles never overlap): NLLs (lower is
    better), then rates (higher is better)."""
    title = "Before and after the fine-tune"
    rows = comparison_rows(metrics)
    if not rows:
        return empty_figure(title, "Run a fine-tune to compare the model before and after.")
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.22,
                        subplot_titles=("NLL (lower is better)", "Exact / agreement (higher is better)"))
    lower = {label: lower_better for _, label, lower_better in METRICS}
    for col, want_lower in ((1, True), (2, False)):
        part = [r for r in rows if lower[r[1]] == want_lower]
        x = [f"{r[1]} · {r[0]}" for r in part]
        for idx, phase in ((2, "before"), (3, "after")):
            fig.add_bar(x=x, y=[r[idx] for r in part], name=phase, marker_color=COLORS[phase],
                        showlegend=col == 1, legendgroup=phase, row=col, col=1,
                        hovertemplate="%{x}: %{y:.4f}<extra>" + phase + "</extra>")
    fig.update_yaxes(range=[0, 1], row=2, col=1)
    fig.update_layout(title=title, barmode="group", **{**LAYOUT, "height": 560})
    return fig


__all__ = ["ADAPTER_ROOT", "COMPARISON_COLUMNS", "FinetuneBusyError", "FinetuneJob", "JobEvent", "METRICS", "Plan",
           "PlannedBranch", "adapter_dir", "build_request", "comparison_figure", "comparison_rows", "default_name",
           "is_running", "loss_figure", "parent_path", "plan", "start",
           # what the Fine-tune tab needs of the training machinery, so the UI reaches it through this layer only
           "MAX_HELDOUT_ROWS", "MAX_REPLAY_RATIO", "MAX_UNSEEN_ROWS", "WORSE_BY", "FinetuneError", "FinetuneResult",
           "checkpoint_summary", "validate_request"]
