"""Predicted-vs-actual metrics for one rehearsed call, and their aggregation."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable

from app.formats import canonical_json
from app.records import Metrics
from model_backend.loops import repeated_phrase


def is_error(value: Any) -> bool:
    """A tool response that reports failure: `{"error": ...}` (the convention of every env here)."""
    return isinstance(value, dict) and "error" in value


def flatten(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Leaf (path, canonical value) pairs; list items keep their index in the path."""
    if isinstance(value, dict):
        if not value:
            return [(prefix, "{}")]
        return [pair for k in sorted(value, key=str) for pair in flatten(value[k], f"{prefix}/{k}")]
    if isinstance(value, list):
        if not value:
            return [(prefix, "[]")]
        return [pair for i, v in enumerate(value) for pair in flatten(v, f"{prefix}[{i}]")]
    return [(prefix, canonical_json(value))]


def field_f1(predicted: Any, actual: Any) -> float:
    """F1 over flattened leaf pairs (a multiset, so repeated leaves count)."""
    p, a = Counter(flatten(predicted)), Counter(flatten(actual))
    overlap = sum((p & a).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / sum(p.values()), overlap / sum(a.values())
    return 2 * precision * recall / (precision + recall)


def compare(predicted: Any, predicted_valid: bool, actual: Any,
            surprise: float | None = None) -> Metrics:
    """Metrics for one branch; `predicted_valid` is False when the rehearsal did not parse."""
    if not predicted_valid:
        return Metrics(json_valid=False, exact=False, field_f1=0.0, error_agree=None, surprise=surprise)
    return Metrics(
        json_valid=True,
        exact=canonical_json(predicted) == canonical_json(actual),
        field_f1=round(field_f1(predicted, actual), 4),
        error_agree=is_error(predicted) == is_error(actual),
        surprise=surprise,
    )


def looping(text: str) -> bool:
    """A prediction that repeats a phrase more than twice inside one string (`model_backend.loops`)."""
    strings: list[str] = []
    in_string, escaped, start = False, False, 0
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                strings.append(text[start:i])
        elif ch == '"':
            in_string, start = True, i + 1
    if in_string:
        strings.append(text[start:])
    return any(repeated_phrase(s) is not None for s in strings)


def mean_nll(token_logprobs: list[float]) -> float | None:
    return -sum(token_logprobs) / len(token_logprobs) if token_logprobs else None


def aggregate(metrics: Iterable[Metrics]) -> dict[str, float | int | None]:
    """Means over the branches where each metric is defined."""
    rows = list(metrics)
    out: dict[str, float | int | None] = {"n": len(rows)}
    for name in ("json_valid", "exact", "field_f1", "error_agree", "surprise"):
        values = [float(getattr(m, name)) for m in rows if getattr(m, name) is not None]
        out[name] = round(sum(values) / len(values), 4) if values else None
        if name == "surprise" and out[name] is not None and math.isnan(out[name]):
            out[name] = None
    return out
