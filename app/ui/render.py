"""Views of episodes for the UI: chat messages, branch cards, state diffs, tables (pure functions).

Everything here takes records and returns plain values (HTML strings, message dicts,
table rows), so it is fast to test and to benchmark. HTML is escaped at every
interpolation, and text from models, tools, imports or other users that goes into Markdown
(chat messages, headers) goes through `md_text`, `md_code` or `md_fence`: it shows as
written and never becomes markup (a link, an image, a tag the sanitizer would keep).
"""
from __future__ import annotations

import difflib
import html
import json
import re
from typing import Any

from deepdiff import DeepDiff

from app.formats import canonical_json
from app.records import Branch, Episode, Step
from app.service import AheadStatus, compute_time, end_reason_text, success_text

PRE_CHARS = 4000
"""Longest JSON shown in a card before it is cut (the full value stays in the store)."""
STATE_CHARS = 20000
DIFF_LINES = 120
"""Diffs longer than this are cut: past that a person reads the stored JSON instead."""
CHAT_CHARS = 1500


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def pretty(value: Any, limit: int = PRE_CHARS) -> str:
    """Canonical (sorted-key) JSON, indented one space a level, cut to `limit` characters."""
    text = json.dumps(value, sort_keys=True, indent=1, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 20] + "\n... (cut)"


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>&~|$#])")


def md_text(text: str) -> str:
    """Untrusted text for Markdown, shown literally: the characters that open markup (tags,
    entities, links and images, emphasis, code, tables, maths, headings) are backslash-escaped
    (CommonMark), so no element can form; ordinary prose passes unchanged."""
    return _MD_SPECIAL.sub(r"\\\1", text)


def _fence_len(text: str, least: int) -> int:
    return max([least] + [len(run) + 1 for run in re.findall(r"`+", text)])


def md_code(text: str) -> str:
    """Untrusted text as an inline code span, with a fence longer than any backtick run inside it."""
    text = " ".join(text.split())
    fence = "`" * _fence_len(text, 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""  # CommonMark strips one space each side
    return f"{fence}{pad}{text}{pad}{fence}"


def md_fence(text: str, lang: str = "") -> str:
    """Untrusted text as a fenced code block that the text itself cannot close."""
    fence = "`" * _fence_len(text, 3)
    return f"{fence}{lang}\n{text}\n{fence}"


def short(value: Any, limit: int = 90) -> str:
    text = value if isinstance(value, str) else canonical_json(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def action_label(b: Branch) -> str:
    if b.kind == "call" and b.call is not None:
        return f"{b.call.name}({short(b.call.arguments, 70)})"
    if b.kind == "answer":
        return f"answer: {short(b.action_text, 70)}"
    return "unparseable action"


# ---------------------------------------------------------------- conversation


def _step_messages(step: Step) -> list[dict[str, Any]]:
    b = step.chosen_branch
    if b.kind == "answer":
        return [{"role": "assistant", "content": md_text(b.action_text.strip()[:CHAT_CHARS])}]
    # Plain text labels (no emoji: a machine without an emoji font shows a broken box), and
    # ordinary messages, not collapsed metadata bubbles: the result is what a person reads.
    if b.kind == "parse_error":
        return [{"role": "assistant", "content": f"**Step {step.index} · unparseable action** "
                 f"({md_text(short(b.parse_error or '', 60))})\n{md_fence(b.action_text.strip()[:CHAT_CHARS])}"}]
    outcome = "error" if b.actual_error else ("result: null (no output: success)" if b.actual is None else "result")
    return [{"role": "assistant", "content": f"**Step {step.index} · tool call** {md_code(action_label(b))}  \n"
             f"{outcome}:\n{md_fence(pretty(b.actual, CHAT_CHARS), 'json')}"}]


def chat_messages(turns: list[list[dict[str, str]]], steps: list[Step], open_turn: int | None = None,
                  upto: int | None = None) -> list[dict[str, Any]]:
    """User turns, committed calls with their actual results, final answers (`gr.Chatbot` messages).

    `open_turn`: a turn the agent is in (or about to start) whose user message shows even
    before its first step. `upto`: show steps up to this index only (read-only replay).
    """
    shown = [s for s in steps if upto is None or s.index <= upto]
    last_turn = max([s.turn for s in shown] + ([open_turn] if open_turn is not None else []), default=-1)
    messages: list[dict[str, Any]] = []
    by_turn: dict[int, list[Step]] = {}
    for s in shown:
        by_turn.setdefault(s.turn, []).append(s)
    for t in range(last_turn + 1):
        for m in turns[t] if t < len(turns) else []:
            messages.append({"role": "user", "content": md_text(m["content"])})
        for s in by_turn.get(t, []):
            messages.extend(_step_messages(s))
    return messages


# ---------------------------------------------------------------- branch cards


def json_diff(predicted: Any, actual: Any, raw: str | None = None) -> str:
    """Line diff (difflib) of predicted vs actual over canonical JSON, as highlighted HTML.

    `raw`: the rehearsal's own text, diffed as is when it did not parse as JSON.
    """
    a = (raw[:PRE_CHARS] if raw is not None else pretty(predicted)).splitlines()
    b = pretty(actual).splitlines()
    out: list[str] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            out += [f'<span class="ea-eq">  {esc(line)}</span>' for line in a[i1:i2]]
            continue
        out += [f'<span class="ea-del">- {esc(line)}</span>' for line in a[i1:i2]]
        out += [f'<span class="ea-add">+ {esc(line)}</span>' for line in b[j1:j2]]
    if len(out) > DIFF_LINES:
        out = out[:DIFF_LINES] + [f'<span class="ea-eq">... {len(out) - DIFF_LINES} more line(s)</span>']
    return "".join(out)  # the spans are blocks: a newline between them would double the spacing


def _flag(value: bool | None) -> str:
    return "–" if value is None else ("✓" if value else "✗")


METRIC_HELP = {
    "json_valid": "the rehearsal parsed as JSON",
    "exact": "predicted equals actual (canonical JSON: key order and spacing ignored)",
    "field_f1": "F1 over the (leaf path, value) pairs of predicted vs actual: 1 = every field right",
    "error_agree": "both are errors, or both are successes",
    "surprise": "mean negative log-likelihood per token of the actual response under the Rehearse role "
                "(0 = the model expected it exactly; higher = more surprised)",
}
"""Tooltips of the card's metric names (one text for the UI and the docs)."""


def _metric(name: str, value: str) -> str:
    return f'<span title="{esc(METRIC_HELP[name])}" class="ea-metric">{name} {value}</span>'


def metrics_html(b: Branch) -> str:
    m = b.metrics
    if m.json_valid is None:
        return '<div class="ea-metrics">no metrics: nothing to compare (not rehearsed, or not executed)</div>'
    f1 = "–" if m.field_f1 is None else f"{m.field_f1:.2f}"
    surprise = "–" if m.surprise is None else f"{m.surprise:.2f}"
    return ('<div class="ea-metrics">' + " · ".join([
        _metric("json_valid", _flag(m.json_valid)), _metric("exact", _flag(m.exact)), _metric("field_f1", f1),
        _metric("error_agree", _flag(m.error_agree)), _metric("surprise", surprise)]) + "</div>")


def _not_executed(b: Branch) -> str:
    """Why a call branch has no actual response, as recorded; older traces did not record it."""
    if b.not_executed:
        return f"not executed: {b.not_executed}"
    return "not executed (not committed, and not shadow-executed when this trace was recorded)"


def fork_diff(b: Branch, state_before: dict[str, Any] | None) -> str:
    """The shadow fork's state changes against the step's state before, as a compact table."""
    if b.actual_source != "shadow" or b.shadow_state_after is None or state_before is None:
        return ""
    rows = state_changes(state_before, b.shadow_state_after)
    if not rows:
        return '<div class="ea-fork-diff ea-dim">Fork state: no change.</div>'
    return (f'<details class="ea-fork-diff" open><summary>Fork state diff: {len(rows)} change(s) '
            f'(this call on its own fork; the episode is untouched)</summary>{changes_table(rows)}</details>')


def memory_provenance(b: Branch) -> str:
    """The real transitions the rehearsal was conditioned on (`Branch.memory`): a person sees why the model
    predicted what it did, and which memory misled it."""
    if not b.memory:
        return ""
    rows = "".join(
        f'<tr><td><code>{esc(short(h.arguments, 70))}</code></td><td><code>{esc(short(h.response, 90))}</code></td>'
        f'<td>{esc(h.source)}{" · error" if h.error else ""}</td><td>{esc(h.task_id or "")}</td>'
        f'<td>{"exact call" if h.score >= 1e6 else f"{h.score:.2f}"}</td></tr>'
        for h in b.memory)
    fixed = sum(h.source == "correction" for h in b.memory)
    said = f", {fixed} of them an annotator's correction" if fixed else ""
    return (f'<details class="ea-memory"><summary>Rehearsed with {len(b.memory)} real transition(s) from memory'
            f'{said}</summary><table class="ea-table"><tr><th>arguments</th><th>real response</th><th>source</th>'
            f'<th>task</th><th>match</th></tr>{rows}</table></details>')


def branch_card(b: Branch, state_before: dict[str, Any] | None = None) -> str:
    """One branch as a card. `state_before`: the step's state, to diff a shadow fork's state against."""
    classes = "ea-card ea-committed" if b.chosen else "ea-card"
    badge = '<span class="ea-badge ea-badge-committed">✓ committed</span>' if b.chosen else \
        '<span class="ea-badge">not committed</span>'
    origin = "alternative" if b.sampled else "greedy"  # sampled, or forced onto another tool (`proposal`)
    dup = f" · proposed {b.duplicates + 1}×" if b.duplicates else ""
    if b.metrics.exact is False:
        badge += ' <span class="ea-badge ea-badge-diverged" title="the rehearsal did not predict the actual response">prediction diverged</span>'
    elif b.metrics.exact:
        badge += ' <span class="ea-badge ea-badge-matched">prediction matched</span>'

    scores = " ".join(f"{esc(k)} {v:.3f}" for k, v in b.scores.items())
    head = (f'<div class="ea-card-head">{badge} <b>b{b.index}</b> <span class="ea-dim">{origin}{dup}</span> '
            f'<code class="ea-action">{esc(action_label(b))}</code>'
            + (f' <span class="ea-scores">scores: {scores}</span>' if scores else "") + "</div>")
    if b.kind == "parse_error":
        body = (f'<div class="ea-parse-error">Parse error: {esc(b.parse_error)}</div>'
                f'<pre class="ea-pre">{esc(b.action_text[:PRE_CHARS])}</pre>')
    elif b.kind == "answer":
        body = (f'<div class="ea-label">Final answer (nothing to rehearse)</div>'
                f'<pre class="ea-pre">{esc(b.action_text.strip()[:PRE_CHARS])}</pre>')
    else:
        invalid = b.predicted_text is not None and b.predicted is None and b.metrics.json_valid is not True
        if b.predicted_text is None:
            predicted = '<pre class="ea-pre ea-dim">not rehearsed (mode none)</pre>'
        elif invalid:
            predicted = (f'<div class="ea-parse-error">Not valid JSON</div>'
                         f'<pre class="ea-pre">{esc(b.predicted_text[:PRE_CHARS])}</pre>')
        else:
            predicted = f'<pre class="ea-pre">{esc(pretty(b.predicted))}</pre>'
        if b.actual_source is None:
            actual_label = "Actual · none"
            actual = f'<pre class="ea-pre ea-dim">{esc(_not_executed(b))}</pre>'
        else:
            actual_label = f"Actual · {b.actual_source}" + (" · error" if b.actual_error else "")
            shown = "null (no output: success)" if b.actual is None and not b.actual_error else pretty(b.actual)
            actual = f'<pre class="ea-pre">{esc(shown)}</pre>'
        body = (f'<div class="ea-grid"><div><div class="ea-label">Predicted</div>{predicted}</div>'
                f'<div><div class="ea-label">{esc(actual_label)}</div>{actual}</div></div>')
        if b.predicted_text is not None and b.actual_source is not None:
            body += (f'<details class="ea-diff-box" open><summary>Diff: predicted (-) vs actual (+)</summary>'
                     f'<pre class="ea-diff">{json_diff(b.predicted, b.actual, raw=b.predicted_text if invalid else None)}'
                     '</pre></details>')
        body += memory_provenance(b) + fork_diff(b, state_before)
    return f'<div class="{classes}" data-branch="{b.index}">{head}{body}{metrics_html(b)}</div>'


def proposals(step: Step) -> str:
    """"4 proposed → 2 unique (b0 proposed 3×)": samples equal to an earlier candidate fold into it."""
    proposed = sum(1 + b.duplicates for b in step.branches)
    folded = [f"b{b.index} proposed {b.duplicates + 1}×" for b in step.branches if b.duplicates]
    return f"{proposed} proposed → {len(step.branches)} unique" + (f" ({', '.join(folded)})" if folded else "")


def step_header(step: Step) -> str:
    return (f'<div class="ea-step-head">Step {step.index} · turn {step.turn + 1} · {esc(proposals(step))} · '
            f'{step.rehearsals} rehearsed · {step.shadow_calls} shadow · {step.external_calls} external · '
            f'{esc(compute_time(step))}</div>')


def branch_cards(step: Step | None, empty: str = "No step yet: press Step.") -> str:
    if step is None:
        return f'<div class="ea-cards"><div class="ea-empty">{esc(empty)}</div></div>'
    return ('<div class="ea-cards">' + step_header(step)
            + "".join(branch_card(b, step.state_before) for b in step.branches) + "</div>")


# ---------------------------------------------------------------- state


def _path(p: str) -> str:
    return p[4:] if p.startswith("root") else p


def state_changes(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, str, Any, Any]]:
    """(path, change, old, new) rows from deepdiff, in path order."""
    diff = DeepDiff(before, after, verbose_level=2)
    rows: list[tuple[str, str, Any, Any]] = []
    for kind, items in diff.items():
        if kind in ("values_changed", "type_changes"):
            rows += [(_path(p), "changed", v.get("old_value"), v.get("new_value")) for p, v in items.items()]
        elif kind.endswith("_added"):
            rows += [(_path(p), "added", None, v) for p, v in dict(items).items()]
        elif kind.endswith("_removed"):
            rows += [(_path(p), "removed", v, None) for p, v in dict(items).items()]
    return sorted(rows, key=lambda r: r[0])


def changes_table(rows: list[tuple[str, str, Any, Any]]) -> str:
    """`state_changes` rows as an HTML table (path, change, before, after)."""
    body = "".join(f'<tr class="ea-{kind}"><td><code>{esc(path)}</code></td><td>{kind}</td>'
                   f'<td><code>{esc(short(old, 120)) if kind != "added" else ""}</code></td>'
                   f'<td><code>{esc(short(new, 120)) if kind != "removed" else ""}</code></td></tr>'
                   for path, kind, old, new in rows)
    # Fixed layout (assets): the columns share the container's width and long paths wrap, never overflow it.
    return (f'<table class="ea-table"><colgroup><col style="width:40%"><col style="width:64px"><col><col>'
            f'</colgroup><thead><tr><th>path</th><th>change</th><th>before</th><th>after</th>'
            f'</tr></thead><tbody>{body}</tbody></table>')


def state_view(step: Step | None) -> str:
    if step is None:
        return '<div class="ea-state"><div class="ea-empty">The environment state appears after the first step.</div></div>'
    rows = state_changes(step.state_before, step.state_after)
    table = changes_table(rows) if rows else '<div class="ea-dim">No state change in this step.</div>'
    states = "".join(f'<details><summary>State {when}</summary>'
                     f'<pre class="ea-pre">{esc(pretty(value, STATE_CHARS))}</pre></details>'
                     for when, value in (("before", step.state_before), ("after", step.state_after)))
    return (f'<div class="ea-state"><div class="ea-label">State diff, step {step.index}: {len(rows)} change(s)</div>'
            f'{table}{states}</div>')


# ---------------------------------------------------------------- episode summaries


def timeline_choices(steps: list[Step]) -> list[tuple[str, int]]:
    return [(f"{s.index} · t{s.turn + 1} · {short(action_label(s.chosen_branch), 40)}", s.index) for s in steps]


def episode_status(ep: Episode | None, note: str = "") -> str:
    if ep is None:
        return f"No episode yet. {note}".strip()
    s = ep.settings
    success = {None: "–", True: "yes", False: "no"}[ep.success]
    turns = ", ".join(f"t{t.turn + 1} {'✓' if t.success else '✗'}" for t in ep.turn_results) or "–"
    status = "in progress" if ep.status == "running" else ep.status  # "running" read as busy after a step
    ended = end_reason_text(ep)
    return (f"**Episode** {md_code(ep.id)} · task {md_code(ep.task_id)} · **{status}**, {len(ep.steps)} step(s) · "
            f"external calls {ep.external_calls} · shadow {ep.shadow_calls} · rehearsals {ep.rehearsals} · "
            f"turns {turns} · success {success}  \n"
            f"model {md_code(ep.model)}{f' + {md_code(ep.adapter)}' if ep.adapter else ''} · mode {s.mode} · K {s.branches} · "
            f"selector {s.selector} · T {s.temperature} · seed {s.seed} · shadow {'on' if s.shadow else 'off'} · "
            f"context {s.rehearsal_context} · candidates {s.proposal} · relevance {s.relevance:g} · constrained {'on' if s.constrain else 'off'}"
            + (f"  \n**Ended:** {md_text(ended)}" if ended else "") + trace_source_line(ep)
            + (f"  \n**Rehearsal** of episode {md_code(ep.source_episode)}: each committed call is the recorded one "
               "with its recorded response, predicted by this model from the recorded history" if ep.source_episode
               else "") + (f"  \n{note}" if note else ""))


def trace_source_line(ep: Episode) -> str:
    """An imported trace's origin and what its file did not record (empty for an episode run here)."""
    src = ep.trace
    if src is None:
        return ""
    missing = "; ".join(src.missing) if src.missing else "nothing"
    return (f"  \n**Imported** from {md_code(src.file or '(upload)')} ({src.format}, {md_text(src.trace_id)}) · "
            f"{len(src.tools)} tool(s) · **not recorded:** {md_text(missing)}")


def ahead_line(status: AheadStatus) -> str:
    """The Run tab's line under the buttons: whether the next step is being computed ahead, or is ready."""
    if status.state == "computing":
        return (f"Computing step {status.step} ahead while you read ({status.seconds:.0f} s so far): "
                "Step now waits only for what is left.")
    if status.state == "ready":
        return f"✓ Step {status.step} is computed ahead (in {status.seconds:.1f} s): Step only commits it."
    return ""


EPISODE_COLUMNS = ["id", "task", "mode", "K", "selector", "model", "adapter", "status", "success", "steps",
                   "external calls", "created"]
EPISODE_COLUMN_WIDTHS = ["125px", "210px", "100px", "40px", "85px", "85px", "115px", "110px", "150px", "60px",
                         "85px", "150px"]
"""The Traces table's column widths (1,315 px: a 1400 px window's page): each column as wide as its header and its
usual values (a task id, "interrupted", a date) in the table's monospace font; the squeezed default wrapped
"success" a letter a line and cut the date off."""


def episode_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """The Traces table's rows: the adapter by its directory's name (the full path is in the episode)."""
    return [[r["id"], r["task_id"], r["mode"], r["branches"], r["selector"], r["model"],
             (r["adapter"] or "").rstrip("/").rsplit("/", 1)[-1], r["status"],
             success_text(r["status"], r["success"], r["task_id"]), r["n_steps"], r["external_calls"],
             (r["created_at"] or "")[:16].replace("T", " ")] for r in rows]


def comparison(a: Episode, b: Episode, first: int | None) -> str:
    """Two episodes step by step, the first differing step marked."""
    n = max(len(a.steps), len(b.steps))
    verdict = ("They commit the same actions at every step." if first is None
               else f"First difference at step {first}.")
    rows = []
    for i in range(n):
        cells = []
        for ep in (a, b):
            s = ep.steps[i] if i < len(ep.steps) else None
            cells.append("" if s is None else f"<code>{esc(action_label(s.chosen_branch))}</code>"
                         f" <span class=\"ea-dim\">({len(s.branches)} br.)</span>")
        mark = ' class="ea-first-diff"' if i == first else ""
        flag = " ◀ first difference" if i == first else ""
        rows.append(f"<tr{mark}><td>{i}{flag}</td><td>{cells[0]}</td><td>{cells[1]}</td></tr>")
    head = (f'<div class="ea-label">{esc(verdict)}</div><table class="ea-table"><thead><tr><th>step</th>'
            f'<th>A: {esc(a.id)} ({esc(a.settings.mode)}, {esc(a.task_id)})</th>'
            f'<th>B: {esc(b.id)} ({esc(b.settings.mode)}, {esc(b.task_id)})</th></tr></thead><tbody>')
    return f'<div class="ea-compare">{head}{"".join(rows)}</tbody></table></div>'
