"""Small helpers the tests share: a free port, and waiting for a condition instead of sleeping."""
from __future__ import annotations

import socket
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05,
               message: str | Callable[[], str] = "") -> T:
    """Poll `predicate` until it returns something truthy, and return that; AssertionError after `timeout`
    seconds (with `message`, or what it returns). An exception in `predicate` propagates at once, so a
    predicate can stop the wait early (a process that died)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            text = message() if callable(message) else message
            raise AssertionError(f"timed out after {timeout:g} s" + (f": {text}" if text else ""))
        time.sleep(interval)


def gradio_queue_idle(demo) -> bool:
    """No event waits in, or runs through, the Gradio app's queue (events outside the queue do not count)."""
    queue = demo._queue
    return (all(not q.queue for q in list(queue.event_queue_per_concurrency_id.values()))
            and all(job is None for job in list(queue.active_jobs)))


def need_servers() -> None:
    """Skip the calling test, naming what is missing, unless `make mcp-deps` installed the MCP test servers."""
    import pytest

    from app.envs.mcp import servers_dir

    missing = [p for p in (servers_dir() / "sqlite/bin/mcp-server-sqlite", servers_dir() / "git/bin/mcp-server-git",
                           servers_dir() / "node_modules/@modelcontextprotocol/server-filesystem/dist/index.js")
               if not p.exists()]
    if missing:
        pytest.skip(f"MCP test servers missing ({', '.join(map(str, missing))}): run `make mcp-deps`")


def form(**overrides):
    """Every Run tab field, as the page sends them (the tab's defaults unless overridden)."""
    from app.ui import constants as C

    d = C.UI_DEFAULTS
    values = dict(source=C.SOURCE_TASK, task=C.DEFAULT_TASK, instruction="", instruction_env="GorillaFileSystem",
                  model=C.DEFAULT_MODEL, adapter=C.NO_ADAPTER, mode=d["mode"], branches=3, selector=d["selector"],
                  temperature=d["temperature"], seed=d["seed"], shadow=d["shadow"],
                  rehearsal_context=d["rehearsal_context"], tool_choice=d["tool_choice"],
                  proposal=d["proposal"], relevance=0,  # the scripted candidates stay the test's own
                  constrain=d["constrain"], max_action_tokens=d["max_action_tokens"], max_rehearsal_tokens=d["max_rehearsal_tokens"])
    values.update(overrides)
    return values
