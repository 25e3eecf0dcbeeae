"""Everything that touches model weights: loading, the two-role policy, scoring.

Importing this package stays light: torch and transformers load on first use of
`load_policy` / `TransformersPolicy`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (CAPABILITIES, NO_PROMPT_LOGPROBS, Generation, GenerationConfig, Policy, Prompt,
                   RemoteCapabilityError)
from .factory import load_policy
from .loading import AdapterError, LoadedModel, MissingModelError, load_model
from .spec import ModelSpec, ModelSpecError, parse_spec

if TYPE_CHECKING:
    from .policy import TransformersPolicy
    from .remote import OpenAIPolicy, RemoteError

__all__ = [
    "AdapterError",
    "CAPABILITIES",
    "Generation",
    "GenerationConfig",
    "LoadedModel",
    "MissingModelError",
    "ModelSpec",
    "ModelSpecError",
    "NO_PROMPT_LOGPROBS",
    "OpenAIPolicy",
    "Policy",
    "Prompt",
    "RemoteCapabilityError",
    "RemoteError",
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
    if name in ("OpenAIPolicy", "RemoteError"):  # httpx + tenacity: only when a server is named
        from . import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
