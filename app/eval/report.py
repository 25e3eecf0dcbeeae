"""Rendering of an eval result (`app.eval.evaluation.run_eval`): results.json, results.md, plotly figures.

No metrics are computed here: every number comes from the result dict.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from app.eval.evaluation import BEST_OF_K

log = logging.getLogger(__name__)

COLUMNS: tuple[tuple[str, str], ...] = (
    ("task_success", "task success"),
    ("turn_success", "turn success"),
    ("call_accuracy", "call acc."),
    ("external_calls_per_task", "ext. calls/task"),
    ("rehearsals_per_task", "rehearsals/task"),
    ("shadow_calls_per_task", "shadow calls/task"),
    ("exact", "exact"),
    ("field_f1", "field F1"),
    ("error_agree", "error agree"),
    ("surprise", "surprise"),
    ("wall_s_per_task", "wall s/task"),
)
FIDELITY_COLUMNS = ("n", "json_valid", "exact", "field_f1", "error_agree", "surprise")
FIGURE_FILE = "figures.html"


def row_label(row: dict[str, Any]) -> str:
    s = row["settings"]
    if row["row"] == BEST_OF_K:
        return f"real best-of-K (K={s['branches']})"
    if s["mode"] == "none":
        return "none"
    return f"{s['mode']} (K={s['branches']}, {s['selector']})"


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in rows])


def table_markdown(result: dict[str, Any]) -> str:
    """The main table: one row per mode, then the real best-of-K row."""
    return "\n".join(_table(["row"] + [label for _, label in COLUMNS],
                            [[row_label(r)] + [r[key] for key, _ in COLUMNS] for r in result["rows"]]))


def markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    tasks = result["tasks"]
    turns = f"the first {cfg['max_turns']} turn(s) of each task" if cfg.get("max_turns") else "all turns"
    lines = [
        "# Evaluation", "",
        f"Model `{cfg['model']}`" + (f" with adapter `{cfg['adapter']}`" if cfg.get("adapter") else " (no adapter)")
        + f"; {len(tasks)} task(s) ({_task_summary(tasks)}), {turns}; seed {cfg['seed']}, "
        f"temperature {cfg['temperature']}, step budget per turn "
        f"{cfg['max_steps_per_turn'] or 'from the task'}.", "",
        _memory_line(result) + " " + _selection_line(cfg), "",
    ]
    if result.get("constraints"):  # a model server: how it kept the constrained decoding the rows ask for
        lines += [f"Model server: {result['constraints']}.", ""]
    lines += [table_markdown(result), ""]
    lines += [
        "Task and turn success: BFCL's state and response checks. Call accuracy: committed steps whose call "
        "equals (canonical name + arguments) one of the turn's ground-truth calls, over committed steps in "
        "judged turns with ground truth. External calls: calls that reached the real environment "
        "(best-of-K: every candidate executed on a fork). Fidelity (exact, field F1, error agreement, "
        "surprise = mean NLL per token of the real response): every rehearsed branch that has an actual "
        "response (committed or shadow). Wall time: the steps' own time, summed per task.", "",
    ]
    fid = result["fidelity"]
    for title, key in (("Fidelity by tool", "by_tool"), ("Fidelity: read-only vs state-changing calls", "by_access")):
        lines += [f"## {title}", ""]
        groups = fid.get(key) or {}
        if groups:
            lines += _table(["group"] + list(FIDELITY_COLUMNS),
                            [[name] + [g.get(c) for c in FIDELITY_COLUMNS] for name, g in groups.items()])
        else:
            lines.append("No rehearsed branch with an actual response (modes with rehearsal were not run).")
        lines.append("")
    lines += ["## Fidelity with vs without the environment-state snapshot", ""]
    probe = fid.get("by_context")
    if probe and probe.get("calls"):
        lines += [f"The same {probe['calls']} call(s) with their real response, rehearsed twice: with the "
                  "history of calls and results, and with that history plus the state before the step.", ""]
        lines += _table(["rehearsal context"] + list(FIDELITY_COLUMNS[:-1]),
                        [[c] + [probe[c].get(k) for k in FIDELITY_COLUMNS[:-1]] for c in ("history", "history+state")])
    else:
        lines.append("Not measured (`--state-probe 0`, or no call with a real response).")
    run = result.get("run", {})
    lines += ["", f"Episodes run: {run.get('episodes_run')}, resumed from the database: "
              f"{run.get('episodes_resumed')}; {run.get('seconds')} s. Episode ids per row: `results.json`."]
    return "\n".join(lines) + "\n"


MEMORY_WORDS = {
    "off": "off: no retrieved transitions",
    "seed": "seed: replays of the training split's ground truth and calls explored from its states",
    "online": "online: the seed and every real response observed since (this eval's other tasks included)",
}


def _memory_line(result: dict[str, Any]) -> str:
    """Which real transitions the Rehearse prompts retrieved from (the evaluated task's own never)."""
    memory = result.get("memory") or {"mode": result["config"].get("memory", "off")}
    held = memory.get("transitions_at_start") or {}
    held_text = f" ({sum(held.values())} transitions at the start)" if held else ""
    return (f"Rehearsal memory {MEMORY_WORDS.get(memory['mode'], memory['mode'])}{held_text}; "
            f"up to {memory.get('k', 3)} per Rehearse prompt; never the evaluated task's own transitions "
            "from another episode.")


def _selection_line(cfg: dict[str, Any]) -> str:
    """The parallel rows' commit rule (RunSettings.keep_primary; configs written before it: off)."""
    if cfg.get("keep_primary", False):
        return ("Selection keeps the greedy primary unless its rehearsal predicts an error and the selector's "
                "choice's does not.")
    return "Selection commits the selector's top score."


def _task_summary(tasks: list[str]) -> str:
    return ", ".join(tasks) if len(tasks) <= 4 else f"{tasks[0]} ... {tasks[-1]}"


def figures(result: dict[str, Any]) -> list[Any]:
    """The rows' success and cost, and fidelity by tool, by access, by context."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    layout = {"template": "plotly_white", "height": 380, "margin": {"l": 50, "r": 20, "t": 60, "b": 80}}
    labels = [row_label(r) for r in result["rows"]]
    fig_rows = make_subplots(rows=1, cols=2, subplot_titles=("success (higher is better)", "external calls per task"))
    for key, name in (("task_success", "task success"), ("turn_success", "turn success"),
                      ("call_accuracy", "call accuracy")):
        fig_rows.add_bar(x=labels, y=[r[key] for r in result["rows"]], name=name, row=1, col=1)
    fig_rows.add_bar(x=labels, y=[r["external_calls_per_task"] for r in result["rows"]], name="external calls",
                     row=1, col=2)
    fig_rows.update_yaxes(range=[0, 1], row=1, col=1)
    fig_rows.update_layout(title="Rows: test-time rehearsal vs real best-of-K", barmode="group", **layout)
    out = [fig_rows]
    fid = result["fidelity"]
    groups = [("Rehearsal fidelity by tool", fid.get("by_tool") or {}),
              ("Rehearsal fidelity: read-only vs state-changing", fid.get("by_access") or {})]
    probe = fid.get("by_context")
    if probe and probe.get("calls"):
        groups.append((f"Fidelity with vs without the state snapshot ({probe['calls']} calls)",
                       {c: probe[c] for c in ("history", "history+state")}))
    for title, data in groups:
        fig = go.Figure()
        names = list(data)
        for metric in ("exact", "field_f1", "error_agree"):
            fig.add_bar(name=metric, x=names, y=[data[n].get(metric) for n in names],
                        customdata=[data[n].get("n") for n in names],
                        hovertemplate="%{x}: %{y:.2f} (n=%{customdata})<extra>" + metric + "</extra>")
        fig.update_layout(title=title, barmode="group", yaxis={"range": [0, 1]}, **layout)
        out.append(fig)
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def write_pngs(figs: list[Any], out_dir: Path) -> list[Path]:
    """figure_N.png for each figure, in one browser session, where kaleido and a Chrome/Chromium exist.

    PNGs are a convenience next to figures.html: without kaleido (a Space) or without a
    browser, they are skipped with a warning, never an error that loses the table.
    """
    if importlib.util.find_spec("kaleido") is None:
        log.info("PNG figures skipped: kaleido is not installed")
        return []
    import plotly.io as pio

    paths = [out_dir / f"figure_{i + 1}.png" for i in range(len(figs))]
    try:
        pio.write_images(figs, [str(p) for p in paths])
    except RuntimeError as exc:  # kaleido's ChromeNotFoundError and browser start failures
        log.warning("PNG figures skipped: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        for path in paths:
            path.unlink(missing_ok=True)
        return []
    return paths


def write_outputs(result: dict[str, Any], out: str | os.PathLike[str]) -> list[Path]:
    """results.json, results.md, figures.html (one self-contained page), and PNGs where possible (`write_pngs`)."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "results.json", out_dir / "results.md", out_dir / FIGURE_FILE]
    _write_atomic(written[0], json.dumps(result, indent=2, ensure_ascii=False, default=str) + "\n")
    _write_atomic(written[1], markdown(result))
    figs = figures(result)
    html = "\n".join(fig.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(figs))
    _write_atomic(written[2], f"<!doctype html><html><head><meta charset='utf-8'><title>Evaluation</title>"
                              f"</head><body>{html}</body></html>\n")
    written += write_pngs(figs, out_dir)
    return written


__all__ = ["COLUMNS", "FIGURE_FILE", "figures", "markdown", "row_label", "table_markdown", "write_outputs",
           "write_pngs"]
