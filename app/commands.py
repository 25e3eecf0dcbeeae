"""Extra CLI subcommands owned by other modules.

Each listed module exposes `register(subparsers)` and must import fast (no torch at
import time) so that `python -m app --help` stays instant.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable, Iterator

MODULES = ("app.train_cli", "app.eval_cli", "app.export_cli")


def registrars() -> Iterator[Callable[[Any], None]]:
    for name in MODULES:
        if importlib.util.find_spec(name) is not None:
            yield importlib.import_module(name).register
