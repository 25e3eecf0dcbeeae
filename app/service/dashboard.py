"""Plotly figures of the Dashboard, built from the store's read queries (no SQL here).

Each builder takes plain rows (dicts) and returns a `plotly.graph_objects.Figure`; an
empty input gives a figure that says so ("No data: ..."), never an exception. Every title says how many samples
the figure rests on (`n=`), every bar and point its own n (in the axis label or the hover), and a value that
has no data is marked "no data" where it would stand, never drawn as a 0.
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


NO_DATA = "no data"
"""What stands where a value has no sample (a bar of 0 is a measured 0)."""


def titled(title: str, n: int, what: str) -> str:
    """A figure's title with the samples it rests on: "Rehearsal fidelity by tool · n=12 rehearsed calls"."""
    return f"{title} · n={n} {what}"


def empty_figure(title: str, why: str = "No data: run some steps (Run tab) or loosen the filters.") -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=why, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(title=title, xaxis={"visible": False}, yaxis={"visible": False}, **LAYOUT)
    return fig


def mean_of(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None (None when there are none)."""
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


FIDELITY_METRICS = ("exact", "field_f1", "error_agree")


def fidelity_by_tool(branches: list[dict[str, Any]]) -> go.Figure:
    """Per tool: exact match, field F1 and error agreement of the rehearsed response. Every tool the agent called
    is on the axis with its n (rehearsed calls with an actual response to compare); one with none says "no data"."""
    title = "Rehearsal fidelity by tool"
    called: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in branches:
        if r["call_name"]:
            called[r["call_name"]].append(r)
    by_tool = {t: [r for r in rows if r["json_valid"] is not None] for t, rows in called.items()}
    n = sum(len(rows) for rows in by_tool.values())
    if not n:
        return empty_figure(title, "No data: no rehearsed call has an actual response to compare with yet "
                                   "(run steps in a rehearsal mode, or loosen the filters).")
    tools = sorted(by_tool, key=lambda t: (-len(by_tool[t]), t))
    labels = [f"{t} (n={len(by_tool[t])})" for t in tools]
    fig = go.Figure()
    for metric in FIDELITY_METRICS:
        values = [[r[metric] for r in by_tool[t] if r[metric] is not None] for t in tools]
        means = [mean_of(v) for v in values]
        fig.add_bar(name=metric, x=labels, y=means, customdata=[len(v) for v in values],
                    text=["" if m is None else f"{m:.2f}" for m in means], textposition="outside",
                    hovertemplate="%{x}: %{y:.2f} (n=%{customdata})<extra>" + metric + "</extra>")
    for label, t in zip(labels, tools):
        if not by_tool[t]:  # called, never compared: its bars would all be missing
            fig.add_annotation(x=label, y=0.05, text=NO_DATA, showarrow=False, yanchor="bottom")
    fig.update_layout(title=titled(title, n, "rehearsed calls"), barmode="group",
                      yaxis={"range": [0, 1.15], "title": "mean"}, **LAYOUT)
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
    n = sum(len(v) for by_step in series.values() for v in by_step.values())
    fig = go.Figure()
    for mode, by_step in sorted(series.items()):
        steps = sorted(by_step)
        fig.add_scatter(name=mode, x=steps, y=[mean_of(by_step[s]) for s in steps], mode="lines+markers",
                        customdata=[len(by_step[s]) for s in steps],
                        hovertemplate="step %{x}: %{y:.2f} (n=%{customdata})")
    fig.update_layout(title=titled(title, n, "compared responses"), xaxis={"title": "step index", "dtick": 1},
                      yaxis={"range": [0, 1], "title": "1 − field F1"}, **LAYOUT)
    return fig


def success_and_calls_by_mode(episodes: list[dict[str, Any]]) -> go.Figure:
    """Task success rate (judged episodes) and mean external calls per episode, by mode. A rehearsal of a recorded
    episode (`source_episode`) ran nothing: it is not an episode here."""
    title = "Task success and external calls by mode"
    episodes = [e for e in episodes if not e.get("source_episode")]
    by_mode: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in episodes:
        by_mode[e["mode"]].append(e)
    if not by_mode:
        return empty_figure(title)
    modes = sorted(by_mode)
    judged = {m: [e["success"] for e in by_mode[m] if e["success"] is not None] for m in modes}
    n_judged = sum(len(v) for v in judged.values())
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        f"success rate · n={n_judged} judged episodes", f"external calls / episode · n={len(episodes)} episodes"))
    rates = [mean_of(judged[m]) for m in modes]
    labels = [f"{m} (n={len(judged[m])})" for m in modes]
    fig.add_bar(x=labels, y=rates, name="success",
                customdata=[len(judged[m]) for m in modes], hovertemplate="%{x}: %{y:.2f} (n=%{customdata})",
                text=["" if r is None else f"{r:.2f}" for r in rates], textposition="outside", row=1, col=1)
    fig.add_bar(x=[f"{m} (n={len(by_mode[m])})" for m in modes],
                y=[mean_of(e["external_calls"] for e in by_mode[m]) for m in modes], name="external calls",
                customdata=[len(by_mode[m]) for m in modes], hovertemplate="%{x}: %{y:.1f} (n=%{customdata})",
                row=1, col=2)
    fig.update_yaxes(range=[0, 1.15], row=1, col=1)
    if not n_judged:  # e.g. only typed instructions, which have no ground truth to judge against
        fig.add_annotation(text="No data: no judged episode<br>(typed instructions and unfinished<br>episodes are "
                                "not judged)", showarrow=False, x=0.5, y=0.5, xref="x domain", yref="y domain")
    else:
        for label, m in zip(labels, modes):
            if not judged[m]:
                fig.add_annotation(x=label, y=0.05, text=NO_DATA, showarrow=False, yanchor="bottom", xref="x", yref="y")
    fig.update_layout(title=title, showlegend=False,  # room for the subplot titles under the title
                      **{**LAYOUT, "margin": {**LAYOUT["margin"], "t": 90}})
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
    title = "Selector calibration: score vs success"
    points = []
    for r in branches:
        if r["chosen"] and r["kind"] == "call" and r["actual_source"] == "committed" and r["actual_error"] is not None:
            p = selector_probability(json.loads(r["scores"]) if r["scores"] else {})
            if p is not None:
                points.append((p, 0.0 if r["actual_error"] else 1.0))
    if not points:
        return empty_figure(title, "No data: no scored committed call yet (mode none has no selector score).")
    bins: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for p, ok in points:
        bins[min(int(p * CALIBRATION_BINS), CALIBRATION_BINS - 1)].append((p, ok))
    keys = sorted(bins)
    fig = go.Figure()
    fig.add_scatter(x=[0, 1], y=[0, 1], mode="lines", name="perfect", line={"dash": "dot", "color": "gray"})
    fig.add_scatter(x=[mean_of(p for p, _ in bins[k]) for k in keys], y=[mean_of(ok for _, ok in bins[k]) for k in keys],
                    mode="lines+markers", name="observed", customdata=[len(bins[k]) for k in keys],
                    marker={"size": [8 + 2 * min(len(bins[k]), 10) for k in keys]},
                    hovertemplate="score %{x:.2f}: success %{y:.2f} (n=%{customdata})")
    fig.update_layout(title=titled(title, len(points), "committed calls"),
                      xaxis={"range": [0, 1], "title": "selector score (as probability)"},
                      yaxis={"range": [-0.05, 1.05], "title": "committed call succeeded"}, **LAYOUT)
    return fig


def annotations_by_label(counts: list[dict[str, Any]]) -> go.Figure:
    title = "Annotations by label"
    if not counts:
        return empty_figure(title, "No data: no annotation yet (Annotate tab).")
    n = {c["label"] or "(no label)": c["n"] for c in counts}
    order = [label for label in LABELS if label in n] + [label for label in n if label not in LABELS]
    fig = go.Figure(go.Bar(x=order, y=[n[label] for label in order]))
    fig.update_layout(title=titled(title, sum(n.values()), "annotations"), yaxis={"title": "annotations"}, **LAYOUT)
    return fig


def figures(store: Store, **filters: Any) -> list[go.Figure]:
    """The five dashboard figures under episode filters (model, adapter, mode, since, until)."""
    branches = store.dashboard_branches(**filters)
    return [fidelity_by_tool(branches), divergence_by_step(branches),
            success_and_calls_by_mode(store.find_episodes(limit=100_000, **filters)), calibration(branches),
            annotations_by_label(store.annotation_label_counts(**filters))]
