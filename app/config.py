"""Paths and defaults shared by the CLI and the UI."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TASK = "bfcl:multi_turn_base_0"
DEFAULT_MODEL = "embedded"
ROOT = Path(__file__).resolve().parent.parent
SHIPPED_ADAPTER = ROOT / "fixtures" / "adapters" / "envace-smollm2-135m"
"""The trained EnvACE-style agent (`make train-agent`): the `embedded` model's default adapter."""
DEFAULT_RELEVANCE = 0.5
"""The CLI's, the Run tab's, the eval's and training rollouts' `RunSettings.relevance` (the engine's own
default is 0: off). On the card's held-out protocol, teacher-forced, the expert's tool ranks first at 49
of 154 call steps with 0, at 73 with 0.3-0.5, and at 66 with 1.0 (`app.engine.proposals`)."""


def shipped_adapter() -> str | None:
    """The shipped adapter's directory (relative to the repo when possible), or None if absent."""
    if not (SHIPPED_ADAPTER / "adapter_config.json").is_file():
        return None
    try:
        return str(SHIPPED_ADAPTER.relative_to(Path.cwd()))
    except ValueError:
        return str(SHIPPED_ADAPTER)


def resolve_adapter(model: str, adapter: str | None) -> str | None:
    """`None` -> the shipped adapter for `embedded` (when present); `default` -> the shipped one
    (an error when absent); `none` -> the bare base model; anything else is a directory."""
    if adapter is None or adapter == "default":
        shipped = shipped_adapter() if model == DEFAULT_MODEL else None
        if adapter == "default" and shipped is None:
            raise ValueError("--adapter default: no shipped adapter in fixtures/adapters (run `make train-agent`)")
        return shipped
    if adapter.lower() == "none":
        return None
    return adapter


def default_db_path() -> str:
    """`$ENVACE_DB`, else `/data/envace.db` on a Space with persistent storage, else `./envace.db`."""
    if os.environ.get("ENVACE_DB"):
        return os.environ["ENVACE_DB"]
    data = Path("/data")
    if data.is_dir() and os.access(data, os.W_OK):
        return str(data / "envace.db")
    return "envace.db"
