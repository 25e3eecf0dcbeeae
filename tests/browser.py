"""Debian's Chromium for the browser tests (Playwright's own browser download fails here)."""
from __future__ import annotations

import os
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def launch(playwright: Any) -> Any:
    """A Chromium browser, or a failure that says how to install it (never a skip)."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run `make browser-deps` (apt-get install chromium)")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
