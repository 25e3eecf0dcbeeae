"""Plain views of an episode for the CLI and for JSON output (no engine logic here)."""
from __future__ import annotations

import json
from typing import Any

from app.records import Branch, Episode, Step


def branch_json(b: Branch) -> dict[str, Any]:
    return {
        "index": b.index, "kind": b.kind, "action_text": b.action_text,
        "call": b.call.model_dump() if b.call else None, "parse_error": b.parse_error,
        "sampled": b.sampled, "predicted": b.predicted, "predicted_text": b.predicted_text,
        "actual": b.actual, "actual_source": b.actual_source, "actual_error": b.actual_error,
        "chosen": b.chosen, "scores": b.scores, "metrics": b.metrics.model_dump(),
        "duplicates": b.duplicates, "memory": [h.model_dump() for h in b.memory],
    }


def step_json(s: Step) -> dict[str, Any]:
    return {"index": s.index, "turn": s.turn, "kind": s.kind, "chosen": s.chosen,
            "rehearsals": s.rehearsals, "shadow_calls": s.shadow_calls,
            "external_calls": s.external_calls, "duration_s": s.duration_s, "ahead_s": s.ahead_s,
            "branches": [branch_json(b) for b in s.branches]}


def episode_json(ep: Episode) -> dict[str, Any]:
    """The `run --json` object: at least episode_id, task, success, steps, and the three counters."""
    return {
        "episode_id": ep.id, "task": ep.task_id, "model": ep.model, "adapter": ep.adapter,
        "settings": ep.settings.model_dump(), "status": ep.status, "success": ep.success,
        "end_reason": ep.end_reason, "ended": end_reason_text(ep),
        "turn_results": [t.model_dump() for t in ep.turn_results],
        "external_calls": ep.external_calls, "shadow_calls": ep.shadow_calls,
        "rehearsals": ep.rehearsals, "steps": [step_json(s) for s in ep.steps],
    }


def _turns(n: int) -> str:
    return f"{n} user turn{'' if n == 1 else 's'}"


def end_reason_text(ep: Episode) -> str:
    """Why the episode ended, in one sentence for a person ("" while it runs). Traces recorded before the reason
    was kept tell it from their status, and a finished one from its last step (an answer, else the budget)."""
    if ep.trace is not None:  # an imported trace: it ended where its recording did
        steps = f"{len(ep.steps)} recorded step{'' if len(ep.steps) == 1 else 's'}"
        return (f"imported trace: {steps}, ending with the agent's answer" if ep.end_reason == "answered"
                else f"imported trace: {steps}, ending without an answer from the agent")
    reason = ep.end_reason or {"stopped": "stopped", "failed": "failed", "interrupted": "interrupted"}.get(ep.status)
    if reason is None and ep.status == "finished":
        reason = "answered" if ep.steps and ep.steps[-1].kind == "answer" else "step_budget"
    done = len(ep.turn_results)
    if reason == "answered":
        return f"all {_turns(done)} done: the agent answered the last one"
    if reason == "step_budget":
        last = ep.turn_results[-1].steps if ep.turn_results else len(ep.steps)
        return (f"all {_turns(done)} done: the last one used its whole step budget ({last} step"
                f"{'' if last == 1 else 's'}) without an answer")
    if reason == "no_turn_left":
        return "no user turn was left to answer"
    steps = f"{len(ep.steps)} step{'' if len(ep.steps) == 1 else 's'}"
    if reason == "stopped":
        return (f"stopped after {steps} and {done} finished user turn{'' if done == 1 else 's'} (Stop or Reset "
                "pressed, the task or settings changed, or a run's turn limit)")
    if reason == "failed":
        return f"a step failed after {steps}: {ep.error or 'no error recorded'}"
    if reason == "interrupted":
        return f"interrupted after {steps}: the process running it stopped (continue or discard it in Traces)"
    return ""


def _short(value: Any, limit: int = 110) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_branch(b: Branch) -> list[str]:
    mark = "*" if b.chosen else " "
    if b.kind == "call" and b.call:
        head = f"{b.call.name}({_short(b.call.arguments, 80)})"
    elif b.kind == "answer":
        head = f"answer: {_short(b.action_text, 80)}"
    else:
        head = f"parse error: {b.parse_error}"
    scores = " ".join(f"{k}={v:.3f}" for k, v in b.scores.items())
    lines = [f"  {mark} b{b.index} {head}" + (f"  [{scores}]" if scores else "")
             + (f"  (+{b.duplicates} dup)" if b.duplicates else "")]
    if b.predicted_text is not None:
        lines.append(f"      predicted: {_short(b.predicted if b.predicted is not None else b.predicted_text)}")
    for h in b.memory:
        lines.append(f"      memory ({h.source}{', ' + h.task_id if h.task_id else ''}): "
                     f"{_short(h.arguments, 50)} -> {_short(h.response, 60)}")
    if b.actual_source:
        lines.append(f"      actual ({b.actual_source}): {_short(b.actual)}")
    m = b.metrics
    if m.json_valid is not None:
        lines.append(f"      exact={m.exact} field_f1={m.field_f1} error_agree={m.error_agree} "
                     f"surprise={m.surprise}")
    return lines


def compute_time(s: Step) -> str:
    """What the step's compute took: "4.2 s", or for a step computed ahead "5.3 s (5.1 s computed ahead while
    the step before was read, 0.2 s at Step)"."""
    if not s.ahead_s:
        return f"{s.duration_s:.1f} s"
    return (f"{s.compute_s:.1f} s ({s.ahead_s:.1f} s computed ahead while the step before was read, "
            f"{s.duration_s:.1f} s at Step)")


def format_step(s: Step) -> str:
    head = (f" step {s.index} (turn {s.turn + 1}): {len(s.branches)} branch(es), {s.rehearsals} rehearsed, "
            f"{s.shadow_calls} shadow, {compute_time(s)}")
    return "\n".join([head] + [line for b in s.branches for line in format_branch(b)])
