"""Debian's Chromium for the browser tests (Playwright's own browser download fails here)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def _niced_chromium() -> str:
    """A launcher that gives Chromium the least CPU weight the kernel offers: its autogroup at nice 19 (Playwright
    starts each browser in a session of its own, and with autogroups the kernel shares the CPU between sessions
    first: eight browsers took eight ninths of it from the server under test), and its threads SCHED_IDLE where
    autogroups are off (a plain nice value would not hold: Chromium sets its processes' own). Written afresh at
    each launch (never a stale copy), atomically (threads may race)."""
    path = Path(tempfile.gettempdir()) / f"envace-chromium-low-{os.getuid()}.sh"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name)
    with os.fdopen(fd, "w") as out:
        out.write("#!/bin/sh\n(echo 19 > /proc/self/autogroup) 2>/dev/null\n"
                  f'command -v chrt >/dev/null && exec chrt --idle 0 {CHROMIUM} "$@"\nexec {CHROMIUM} "$@"\n')
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)
    return str(path)


def launch(playwright: Any, nice: bool = False) -> Any:
    """A Chromium browser, or a failure that says how to install it (never a skip).

    `nice`: start it at the least CPU weight (`_niced_chromium`), where several browsers share the two cores with
    the server under test: eight of them at full weight measured a 77 s median step against 3-8 s alone."""
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run `make browser-deps` (apt-get install chromium)")
    return playwright.chromium.launch(executable_path=_niced_chromium() if nice else CHROMIUM, args=ARGS)
