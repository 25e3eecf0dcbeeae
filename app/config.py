"""Paths and defaults shared by the CLI and the UI."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TASK = "bfcl:multi_turn_base_0"
DEFAULT_MODEL = "embedded"


def default_db_path() -> str:
    """`$ENVACE_DB`, else `/data/envace.db` on a Space with persistent storage, else `./envace.db`."""
    if os.environ.get("ENVACE_DB"):
        return os.environ["ENVACE_DB"]
    data = Path("/data")
    if data.is_dir() and os.access(data, os.W_OK):
        return str(data / "envace.db")
    return "envace.db"
