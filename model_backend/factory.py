"""`load_policy`: a spec (and adapter) to a ready `Policy`, local weights or a server.

The only module that knows both kinds; imports point one way: factory -> loading/policy/remote
-> spec. torch (policy) and httpx (remote) are imported on first use, so `import model_backend`
stays light for the CLI's --help.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from .loading import INFERENCE_WEIGHTS, AdapterError, load_model, resolve_device, weights_format
from .spec import parse_spec

if TYPE_CHECKING:
    from .policy import TransformersPolicy

_POLICIES: dict[tuple[str, str | None, str, str], TransformersPolicy] = {}
_POLICIES_LOCK = threading.Lock()


def load_policy(
    spec: str = "embedded",
    adapter: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    device: str = "auto",
    weights: str | None = None,
) -> TransformersPolicy:
    """A `TransformersPolicy`, loaded once per process for each (spec, adapter, device);
    an `OpenAIPolicy` for an `openai:` spec (checked against the server, never cached: a restarted
    server is seen again). `weights`: `fp32` or `fp16` linear weights (local CPU models; default
    $ENVACE_WEIGHTS, else fp16 on a CPU and the model's own dtype on a GPU)."""
    parsed = parse_spec(spec)
    if parsed.kind == "openai":
        if adapter is not None:
            raise AdapterError("an openai: server serves its own weights; load the LoRA adapter in the server "
                               "(e.g. vLLM --enable-lora --lora-modules name=path) and name it after '#'")
        from .remote import load_remote_policy

        return load_remote_policy(spec.strip(), parsed.target)  # type: ignore[return-value]
    from .policy import TransformersPolicy

    dev, _ = resolve_device(device)
    weights = weights_format(weights, default=INFERENCE_WEIGHTS if dev.type == "cpu" else "fp32")
    adapter_key = str(Path(adapter).expanduser().resolve()) if adapter is not None else None
    key = (spec.strip(), adapter_key, str(dev), weights)
    with _POLICIES_LOCK:  # the UI may ask from several threads; load once
        if key not in _POLICIES:
            # Inference only, so the adapter is merged (faster); training loads its own copy.
            loaded = load_model(spec, adapter=adapter, cache_dir=cache_dir, device=str(dev), merge_adapter=True,
                                weights=weights)
            _POLICIES[key] = TransformersPolicy(loaded)
        return _POLICIES[key]
