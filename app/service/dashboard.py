"""Plotly figures of the Dashboard, built from the store's read queries (no SQL here).

Each builder takes plain rows (dicts) and returns a `plotly.graph_objects.Figure`; an
empty input gives a figure that says so, never an exception.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any, Iterable

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.records import LABELS
from app.store import Store

CALIBRATION_BINS = 5
LAYOUT = {"height": 340, "margin": {"l": 50, "r": 20, "t": 50, "b": 50}, "template": "plotly_white"}


def empty_figure(title: str, why: str = "No data yet: run some steps (Run tab) or loosen the filters.") -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=why, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(title=title, xaxis={"visible": False}, yaxis={"visible": False}, **LAYOUT)
    return fig


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def fidelity_by_tool(branches: list[dict[str, Any]]) -> go.Figure:
    """Per tool: exact match, field F1 and error agreement of the rehearsed response."""
    title = "Rehearsal fidelity by tool"
    by_tool: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in branches:
        if r["call_name"] and r["json_valid"] is not None:
            by_tool[r["call_name"]].append(r)
    if not by_tool:
        return empty_figure(title)
    tools = sorted(by_tool, key=lambda t: -len(by_tool[t]))
    fig = go.Figure()
    for metric in ("exact", "field_f1", "error_agree"):
        fig.add_bar(name=metric, x=tools, y=[_mean(r[metric] for r in by_tool[t]) for t in tools],
                    customdata=[len(by_tool[t]) for t in tools],
                    hovertemplate="%{x}: %{y:.2f} (n=%{customdata})<extra>" + metric + "</extra>")
    fig.update_layout(title=title, barmode="group", yaxis={"range": [0, 1], "title": "mean"}, **LAYOUT)
    return fig


def divergence_by_step(branches: list[dict[str, Any]]) -> go.Figure:
    """Mean divergence (1 - field F1) against the step index, one line per mode."""
    title = "Divergence (1 − field F1) by step index"
    series: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in branches:
        if r["field_f1"] is not None:
            series[r["mode"]][r["step_idx"]].append(1.0 - r["field_f1"])
    if not series:
        return empty_figure(title)
    fig = go.Figure()
    for mode, by_step in sorted(series.items()):
        steps = sorted(by_step)
        fig.add_scatter(name=mode, x=steps, y=[_mean(by_step[s]) for s in steps], mode="lines+markers",
                        customdata=[len(by_step[s]) for s in steps],
                        hovertemplate="step %{x}: %{y:.2f} (n=%{customdata})")
    fig.update_layout(title=title, xaxis={"title": "step index", "dtick": 1},
                      yaxis={"range": [0, 1], "title": "1 − field F1"}, **LAYOUT)
    return fig


def success_and_calls_by_mode(episodes: list[dict[str, Any]]) -> go.Figure:
    """Task success rate (judged episodes) and mean external calls per episode, by mode."""
    title = "Task success and external calls by mode"
    by_mode: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in episodes:
        by_mode[e["mode"]].append(e)
    if not by_mode:
        return empty_figure(title)
    modes = sorted(by_mode)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("success rate (judged episodes)", "external calls / episode"))
    fig.add_bar(x=modes, y=[_mean(e["success"] for e in by_mode[m]) for m in modes], name="success",
                customdata=[sum(e["success"] is not None for e in by_mode[m]) for m in modes],
                hovertemplate="%{x}: %{y:.2f} (n=%{customdata})", row=1, col=1)
    fig.add_bar(x=modes, y=[_mean(e["external_calls"] for e in by_mode[m]) for m in modes], name="external calls",
                customdata=[len(by_mode[m]) for m in modes], hovertemplate="%{x}: %{y:.1f} (n=%{customdata})",
                row=1, col=2)
    fig.update_yaxes(range=[0, 1], row=1, col=1)
    fig.update_layout(title=title, showlegend=False, **LAYOUT)
    return fig


def selector_probability(scores: dict[str, float]) -> float | None:
    """The committed branch's selector score as a probability: judge as is, logprob as exp(mean)."""
    if "judge" in scores:
        return min(max(scores["judge"], 0.0), 1.0)
    if "memory" in scores:
        return float(scores["memory"])
    if "logprob" in scores:
        return math.exp(min(scores["logprob"], 0.0))
    return None


def calibration(branches: list[dict[str, Any]]) -> go.Figure:
    """Selector score of committed calls against whether the real call succeeded, in bins."""
    title = "Selector calibration: score vs committed call succeeded"
    points = []
    for r in branches:
        if r["chosen"] and r["kind"] == "call" and r["actual_source"] == "committed" and r["actual_error"] is not None:
            p = selector_probability(json.loads(r["scores"]) if r["scores"] else {})
            if p is not None:
                points.append((p, 0.0 if r["actual_error"] else 1.0))
    if not points:
        return empty_figure(title, "No scored committed calls yet (mode none has no selector score).")
    bins: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for p, ok in points:
        bins[min(int(p * CALIBRATION_BINS), CALIBRATION_BINS - 1)].append((p, ok))
    keys = sorted(bins)
    fig = go.Figure()
    fig.add_scatter(x=[0, 1], y=[0, 1], mode="lines", name="perfect", line={"dash": "dot", "color": "gray"})
    fig.add_scatter(x=[_mean(p for p, _ in bins[k]) for k in keys], y=[_mean(ok for _, ok in bins[k]) for k in keys],
                    mode="lines+markers", name="observed", customdata=[len(bins[k]) for k in keys],
                    marker={"size": [8 + 2 * min(len(bins[k]), 10) for k in keys]},
                    hovertemplate="score %{x:.2f}: success %{y:.2f} (n=%{customdata})")
    fig.update_layout(title=title, xaxis={"range": [0, 1], "title": "selector score (as probability)"},
                      yaxis={"range": [-0.05, 1.05], "title": "committed call succeeded"}, **LAYOUT)
    return fig


def annotations_by_label(counts: list[dict[str, Any]]) -> go.Figure:
    title = "Annotations by label"
    if not counts:
        return empty_figure(title, "No annotations yet (Annotate tab).")
    n = {c["label"] or "(no label)": c["n"] for c in counts}
    order = [label for label in LABELS if label in n] + [label for label in n if label not in LABELS]
    fig = go.Figure(go.Bar(x=order, y=[n[label] for label in order]))
    fig.update_layout(title=title, yaxis={"title": "annotations"}, **LAYOUT)
    return fig


def figures(store: Store, **filters: Any) -> list[go.Figure]:
    """The five dashboard figures under episode filters (model, adapter, mode, since, until)."""
    branches = store.dashboard_branches(**filters)
    return [fidelity_by_tool(branches), divergence_by_step(branches),
            success_and_calls_by_mode(store.find_episodes(limit=100_000, **filters)), calibration(branches),
            annotations_by_label(store.annotation_label_counts(**filters))]
