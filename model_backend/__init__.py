"""Everything that touches model weights: loading, the two-role policy, scoring.

Importing this package stays light: torch and transformers load on first use of
`load_policy` / `TransformersPolicy`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Generation, GenerationConfig, Policy, Prompt
from .loading import (
    AdapterError,
    LoadedModel,
    MissingModelError,
    ModelSpec,
    ModelSpecError,
    load_model,
    load_policy,
    parse_spec,
)

if TYPE_CHECKING:
    from .policy import TransformersPolicy

__all__ = [
    "AdapterError",
    "Generation",
    "GenerationConfig",
    "LoadedModel",
    "MissingModelError",
    "ModelSpec",
    "ModelSpecError",
    "Policy",
    "Prompt",
    "TransformersPolicy",
    "load_model",
    "load_policy",
    "parse_spec",
]


def __getattr__(name: str) -> Any:
    # Lazy: policy.py imports torch, which the CLI's --help should not pay for.
    if name == "TransformersPolicy":
        from .policy import TransformersPolicy

        return TransformersPolicy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
