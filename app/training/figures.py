"""The Fine-tune tab's views: the live loss curve and the before/after table and figure.

Pure functions of the library's numbers (`FinetuneResult.losses`, `.metrics`), as in
`app.service.dashboard`: an empty input gives a figure that says so, never an exception.
"""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from app.service.dashboard import LAYOUT, empty_figure

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


__all__ = ["COMPARISON_COLUMNS", "METRICS", "comparison_figure", "comparison_rows", "loss_figure"]
