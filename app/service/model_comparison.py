"""Comparing world models on the same recorded episodes: per tool and per model, `exact`, `field_f1` and
`error_agree` of their rehearsals (`app.service.rehearsal`), a plotly figure of them, and the recorded calls where
the models predicted differently, to open side by side.

A model is `SPEC[@ADAPTER]` (`embedded`, `embedded@none`, `embedded@path/to/child`, `hf:path`, `openai:url#name`),
its adapter resolved as the CLI's `--adapter` is (`embedded` alone: the shipped adapter). Every (episode, model)
must have been rehearsed; the error names the command that would rehearse a missing one.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.config import resolve_adapter
from app.engine.trace_rehearsal import recorded_calls, rehearsal_id
from app.formats import call_text, canonical_json
from app.records import Branch, Episode
from app.service.dashboard import FIDELITY_METRICS, LAYOUT, NO_DATA, mean_of, empty_figure, titled
from app.service.forms import InputError
from app.store import Store, StoreError

ALL_TOOLS = "(all tools)"


@dataclass(frozen=True)
class ModelRef:
    """One world model: a model spec and its resolved adapter (None: the bare model)."""

    model: str
    adapter: str | None

    @property
    def label(self) -> str:
        return f"{self.model}@{self.adapter or 'none'}"


def parse_models(text: str | list[str] | None) -> list[ModelRef]:
    """`SPEC[@ADAPTER],SPEC...` -> two or more distinct models (InputError otherwise)."""
    items = text if isinstance(text, list) else (text or "").split(",")
    out: list[ModelRef] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        spec, at, adapter = item.rpartition("@") if "@" in item else (item, "", "")
        if at and not adapter.strip():
            raise InputError(f"{item!r}: name an adapter after @ (a directory, `default` or `none`)")
        try:
            ref = ModelRef(spec.strip(), resolve_adapter(spec.strip(), adapter.strip() or None))
        except ValueError as exc:
            raise InputError(f"{item!r}: {exc}") from None
        if ref not in out:
            out.append(ref)
    if len(out) < 2:
        raise InputError("Name two or more models to compare, e.g. embedded,embedded@none "
                         "(SPEC[@ADAPTER], separated by commas).")
    return out


@dataclass
class Disagreement:
    """A recorded call whose rehearsals differ between the models."""

    source_episode: str
    step: int
    tool: str
    call: str
    """The recorded call as the agent wrote it."""
    actual: Any
    branches: dict[str, Branch]
    """Model label -> that model's rehearsal of the call (its committed branch: prediction and metrics)."""

    @property
    def key(self) -> str:
        return f"{self.source_episode} · step {self.step} · {self.tool}"


@dataclass
class ModelComparison:
    models: list[str]
    episodes: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    """One per (tool, model), then (ALL_TOOLS, model): tool, model, n, exact, field_f1, error_agree (means over the
    calls where each is defined; None: no data)."""
    disagreements: list[Disagreement] = field(default_factory=list)
    calls: int = 0
    """Recorded calls compared (each rehearsed by every model)."""

    def as_json(self) -> dict[str, Any]:
        return {"models": self.models, "episodes": self.episodes, "calls": self.calls, "rows": self.rows,
                "disagreements": [{"source_episode": d.source_episode, "step": d.step, "tool": d.tool,
                                   "call": d.call, "actual": d.actual,
                                   "predicted": {m: b.predicted if b.metrics.json_valid else b.predicted_text
                                                 for m, b in d.branches.items()},
                                   "metrics": {m: b.metrics.model_dump(exclude={"surprise"})
                                               for m, b in d.branches.items()}} for d in self.disagreements]}


def _prediction_key(b: Branch) -> str:
    return canonical_json(b.predicted) if b.metrics.json_valid else f"invalid:{b.predicted_text}"


def compare_models(store: Store, episode_ids: list[str], models: list[ModelRef]) -> ModelComparison:
    """The rehearsals of `episode_ids` by each of `models`, compared call by call (InputError when one is missing)."""
    rehearsals: dict[tuple[str, str], Episode] = {}
    for episode_id in episode_ids:
        try:
            source = store.get_episode(episode_id)
        except StoreError as exc:
            raise InputError(str(exc)) from None
        for ref in models:
            try:
                rehearsals[(episode_id, ref.label)] = store.get_episode(rehearsal_id(source.id, ref.model, ref.adapter))
            except StoreError:
                raise InputError(f"episode {episode_id} has no rehearsal by {ref.label}: run `python -m app rehearse "
                                 f"--episodes {episode_id} --model {ref.model} --adapter {ref.adapter or 'none'}` "
                                 "(or Rehearse with a model, in the Traces tab) first") from None
    out = ModelComparison(models=[m.label for m in models], episodes=list(episode_ids))
    metrics: dict[tuple[str, str], list[Branch]] = defaultdict(list)
    for episode_id in episode_ids:
        by_model = {m.label: {s.index: s.chosen_branch for s in recorded_calls(rehearsals[(episode_id, m.label)])}
                    for m in models}
        common = sorted(set.intersection(*(set(v) for v in by_model.values())))
        for index in common:
            branches = {label: steps[index] for label, steps in by_model.items()}
            first = next(iter(branches.values()))
            out.calls += 1
            for label, b in branches.items():
                metrics[(first.call.name, label)].append(b)
                metrics[(ALL_TOOLS, label)].append(b)
            if len({_prediction_key(b) for b in branches.values()}) > 1:
                out.disagreements.append(Disagreement(episode_id, index, first.call.name, call_text(first.call),
                                                      first.actual, branches))
    tools = sorted({t for t, _ in metrics if t != ALL_TOOLS}) + ([ALL_TOOLS] if metrics else [])
    for tool in tools:
        for label in out.models:
            rows = metrics.get((tool, label), [])
            row: dict[str, Any] = {"tool": tool, "model": label, "n": len(rows)}
            for name in FIDELITY_METRICS:
                mean = mean_of(getattr(b.metrics, name) for b in rows)
                row[name] = None if mean is None else round(mean, 4)
            out.rows.append(row)
    return out


def comparison_figure(comparison: ModelComparison) -> go.Figure:
    """One panel per metric; per tool a bar per model (its n in the hover), "no data" where a model has none."""
    title = "World models by tool"
    rows = [r for r in comparison.rows if r["tool"] != ALL_TOOLS]
    if not rows:
        return empty_figure(title, "No data: no recorded call was rehearsed by every model.")
    tools = list(dict.fromkeys(r["tool"] for r in rows))
    fig = make_subplots(rows=1, cols=len(FIDELITY_METRICS), subplot_titles=FIDELITY_METRICS, shared_yaxes=True)
    for i, label in enumerate(comparison.models):
        mine = {r["tool"]: r for r in rows if r["model"] == label}
        for col, metric in enumerate(FIDELITY_METRICS, start=1):
            values = [mine[t][metric] if t in mine else None for t in tools]
            fig.add_bar(name=label, x=tools, y=values, legendgroup=label, showlegend=col == 1,
                        marker={"color": _COLORS[i % len(_COLORS)]},
                        customdata=[mine[t]["n"] if t in mine else 0 for t in tools],
                        text=[NO_DATA if v is None else f"{v:.2f}" for v in values], textposition="outside",
                        hovertemplate="%{x}: %{y:.2f} (n=%{customdata})<extra>" + label + "</extra>",
                        row=1, col=col)
    fig.update_yaxes(range=[0, 1.15])
    fig.update_layout(title=titled(title, comparison.calls, f"recorded calls × {len(comparison.models)} models"),
                      barmode="group", **{**LAYOUT, "height": 380, "margin": {**LAYOUT["margin"], "t": 80}})
    return fig


_COLORS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3")


def table_rows(comparison: ModelComparison) -> list[list[Any]]:
    """The rows as a table: tool, model, n, exact, field_f1, error_agree ("no data" for a missing mean)."""
    return [[r["tool"], r["model"], r["n"], *[NO_DATA if r[m] is None else r[m] for m in FIDELITY_METRICS]]
            for r in comparison.rows]


TABLE_COLUMNS = ["tool", "model", "n", *FIDELITY_METRICS]

__all__ = ["ALL_TOOLS", "Disagreement", "ModelComparison", "ModelRef", "TABLE_COLUMNS", "compare_models",
           "comparison_figure", "parse_models", "table_rows"]
