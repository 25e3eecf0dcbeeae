"""Form fields -> typed records: run settings and annotations, or an `InputError` that says what to fix.

Nothing here touches the store or a model: a rejected form writes nothing.
"""
from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from app.config import DEFAULT_RELEVANCE
from app.envs.base import Tool, call_problems
from app.formats import parse_action
from app.records import LABELS, MODES, Annotation, RunSettings


class InputError(ValueError):
    """Input the user can fix; the message says how (shown in the UI, nothing written)."""


class SessionBusyError(InputError):
    """A second run was asked for while this session's run is still working."""


_SETTING_NAMES = {"branches": "K (branches)", "seed": "Seed", "temperature": "Temperature",
                  "max_action_tokens": "Max action tokens", "max_rehearsal_tokens": "Max rehearsal tokens",
                  "max_steps_per_turn": "Steps per turn", "memory_k": "Transitions per rehearsal",
                  "memory": "Rehearsal memory"}


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def parse_number(label: str, value: Any, low: float, high: float, whole: bool = True) -> float:
    """A form field as a number within [low, high] (a whole one if `whole`), or a clear InputError."""
    kind = "a whole number" if whole else "a number"
    span = f"from {_bound(low)} to {_bound(high)}"
    if value is None or value == "":
        raise InputError(f"{label} is empty: enter {kind} {span}.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{label} must be {kind} {span}; got {value!r}.") from None
    if not math.isfinite(number) or (whole and number != int(number)) or not low <= number <= high:
        raise InputError(f"{label} must be {kind} {span}; got {number:g}.")
    return number


def _whole(name: str, value: Any, low: int, high: int) -> int:
    return int(parse_number(_SETTING_NAMES.get(name, name), value, low, high))


def parse_settings(*, mode: str, branches: Any, selector: str, temperature: Any, seed: Any, shadow: bool,
                   rehearsal_context: str, tool_choice: str = "auto", proposal: str = "sample",
                   relevance: Any = DEFAULT_RELEVANCE, constrain: bool = True,
                   memory: str = "off", memory_k: Any = 3, keep_primary: bool = True,
                   max_action_tokens: Any = 96,
                   max_rehearsal_tokens: Any = 128) -> RunSettings:
    """RunSettings from raw UI values, or an InputError that names the field and its range."""
    if mode not in MODES:
        raise InputError(f"Mode must be one of {', '.join(MODES)}; got {mode!r}.")
    k = _whole("branches", branches, 1, 16)
    values = dict(mode=mode, branches=1 if mode == "none" else k, selector=selector,
                  seed=_whole("seed", seed, 0, 2**31 - 1), shadow=bool(shadow),
                  rehearsal_context=rehearsal_context, tool_choice=tool_choice, proposal=proposal,
                  relevance=parse_number("Tool relevance", relevance, 0, 4, whole=False),
                  constrain=bool(constrain), memory=memory, memory_k=_whole("memory_k", memory_k, 0, 8),
                  keep_primary=bool(keep_primary),
                  max_action_tokens=_whole("max_action_tokens", max_action_tokens, 8, 1024),
                  max_rehearsal_tokens=_whole("max_rehearsal_tokens", max_rehearsal_tokens, 8, 2048))
    try:
        values["temperature"] = float(temperature)
        return RunSettings(**values)
    except (TypeError, ValueError, ValidationError) as exc:
        if isinstance(exc, ValidationError):
            err = exc.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "settings"
            raise InputError(f"{_SETTING_NAMES.get(name, name.replace('_', ' ').capitalize())}: {err['msg']}.") from None
        raise InputError(f"Temperature must be a number from 0 to 2; got {temperature!r}.") from None


ANSWER_HINT = 'tick "plain answer" if the correction is a reply in words, not a tool call'
CALL_FORMAT = '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'


def adapter_for_model(model: str, adapter: str | None, none: str) -> str | None:
    """The Adapter box's value once the person picks `model`: a served model (`openai:`) runs its server's own
    weights, so a LoRA adapter is cleared to `none` (keeping it would refuse every step); other models keep it."""
    return none if str(model or "").strip().startswith("openai:") else adapter


def parse_corrected_response(text: str | None) -> tuple[bool, Any]:
    """The corrected-response field as (set, value): an empty field sets nothing; anything else must be one JSON
    document, and `null`, `""`, `0` and `false` are corrections like any other."""
    text = (text or "").strip()
    if not text:
        return False, None
    try:
        return True, json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"The corrected predicted response is not valid JSON (line {exc.lineno}, "
                         f"column {exc.colno}: {exc.msg}). Fix it or clear the field.") from None


def check_corrected_action(text: str, answer: bool, tools: list[Tool] | None) -> str:
    """The kind of a corrected action (`call` or `answer`), or an InputError: a call must name a tool of the
    step (`tools`) with schema-valid arguments; a plain answer must be marked as one (`answer`)."""
    parsed = parse_action(text)
    if answer:
        if parsed.kind != "answer":
            raise InputError("The corrected action is marked as a plain answer but is written as a tool call: "
                             "untick \"plain answer\", or write the reply in words.")
        return "answer"
    if parsed.kind == "parse_error":
        raise InputError(f"The corrected action does not parse: {parsed.error}. Write {CALL_FORMAT}, or {ANSWER_HINT}.")
    if parsed.kind != "call" or parsed.call is None:
        raise InputError(f"The corrected action is not a tool call: write {CALL_FORMAT}, or {ANSWER_HINT}.")
    if tools is None:
        raise InputError("The corrected action cannot be checked: this step's tools are unknown.")
    problem = call_problems(parsed.call.name, parsed.call.arguments, tools)
    if problem:
        raise InputError(f"The corrected action is not a valid call of this step: {problem}.")
    return "call"


def build_annotation(branch_id: int, label: str | None, corrected_predicted: str, corrected_action: str,
                     note: str, annotator: str, *, answer: bool = False,
                     tools: list[Tool] | None = None) -> Annotation:
    """A validated Annotation, or an InputError saying what to fix (nothing is written).

    `answer`: the corrected action is a plain-text answer (marked as such); otherwise it must be a call of one of
    `tools` (the step's) with schema-valid arguments."""
    label = label or None
    if label is not None and label not in LABELS:
        raise InputError(f"Unknown label {label!r}; pick one of {', '.join(LABELS)}.")
    predicted_set, predicted = parse_corrected_response(corrected_predicted)
    action = (corrected_action or "").strip() or None
    kind = check_corrected_action(action, bool(answer), tools) if action is not None else None
    if label is None and not predicted_set and action is None and not (note or "").strip():
        raise InputError("Nothing to save: pick a label, or give a correction or a note.")
    annotator = (annotator or "").strip()
    if not annotator:
        raise InputError("Annotator is empty: type your name (or sign in on the Space).")
    return Annotation(branch_id=branch_id, label=label, corrected_predicted=predicted,
                      corrected_predicted_set=predicted_set, corrected_action=action, corrected_action_kind=kind,
                      note=(note or "").strip(), annotator=annotator[:100])
