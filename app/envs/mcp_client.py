"""The client side of MCP environments: server configs, one session per server, the event-loop thread.

Contract: `MCPServerConfig` is the format MCP clients use (see `app/envs/mcp.py`); `Session.start()`
connects and lists the tools or raises `MCPStartError` (with the tail of the server's stderr);
`Session.call()` returns the SDK's `CallToolResult` or raises one of `server_errors()`; `Session.stop()`
ends the session and its server process. One daemon thread per process runs every session's
asyncio task; every wait on it is bounded by a time-out.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
STDERR_TAIL = 800
"""Characters of a server's stderr quoted in a start-up or crash error."""


class MCPStartError(RuntimeError):
    """The server could not be started or connected to (bad command, early exit, no answer in time)."""


class MCPServerConfig(BaseModel):
    """One MCP server, in the format MCP clients use (plus `read_only_tools` and time-outs)."""

    model_config = ConfigDict(extra="forbid")

    command: str | None = None
    """The executable of a stdio server."""
    args: list[str] = Field(default_factory=list)
    """Its arguments."""
    env: dict[str, str] | None = None
    """Extra environment variables (merged over the SDK's safe defaults: PATH, HOME, ...)."""
    cwd: str | None = None
    """Working directory of the server process."""
    url: str | None = None
    """The endpoint of a streamable HTTP server (instead of `command`)."""
    read_only_tools: list[str] = Field(default_factory=list)
    """Tools to treat as read-only although the server does not annotate them."""
    error_prefixes: list[str] = Field(default_factory=list)
    """A text result starting with one of these is an error, for servers that report failures as plain
    text without `isError` (mcp-server-sqlite: `Error: ...`, `Database error: ...`)."""
    start_timeout_s: float = 20.0
    """Start-up, handshake and tool listing together (a cold `node` or Python start takes ~1 s)."""
    call_timeout_s: float = 30.0
    """One tool call."""

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerConfig:
        if (self.command is None) == (self.url is None):
            raise ValueError("an MCP server config needs exactly one of `command` (stdio) or `url` (HTTP)")
        if self.url is not None and (self.args or self.env or self.cwd):
            raise ValueError("`args`, `env` and `cwd` apply to stdio servers (`command`), not to `url`")
        return self

    @property
    def label(self) -> str:
        return self.url or " ".join([Path(self.command or "").name, *self.args])[:120]


def servers_dir() -> Path:
    """Where `make mcp-deps` installs the test servers (`{servers}` in configs)."""
    return Path(os.environ.get("ENVACE_MCP_DIR") or REPO_ROOT / ".mcp")


def _expand(text: str, state_dir: Path | None) -> str:
    if "{state}" in text:
        if state_dir is None:
            raise MCPStartError(f"the server config uses {{state}} but the environment has no state folder: {text}")
        text = text.replace("{state}", str(state_dir))
    return text.replace("{servers}", str(servers_dir()))


def _command(command: str) -> str:
    if os.sep in command or shutil.which(command):
        return command
    beside = Path(sys.executable).parent / command  # the venv's bin/, when the venv is not activated
    return str(beside) if beside.exists() else command


# ---------------------------------------------------------------- the event-loop thread

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_thread: threading.Thread | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's MCP event loop, running in a daemon thread (started on first use)."""
    global _loop, _loop_thread
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            _loop_thread = threading.Thread(target=_loop.run_forever, name="mcp-client-loop", daemon=True)
            _loop_thread.start()
        return _loop


def _run(coro: Any, timeout: float) -> Any:
    """Run `coro` on the MCP loop and wait for it, at most `timeout` seconds (then cancel it)."""
    if threading.current_thread() is _loop_thread:
        coro.close()
        raise RuntimeError("a synchronous MCP call from the MCP event-loop thread would wait on itself")
    future = asyncio.run_coroutine_threadsafe(coro, _event_loop())
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout:g} s") from None


# ---------------------------------------------------------------- one session


class Session:
    """One connected client: a task on the MCP loop holds `Client` open until `stop()`."""

    def __init__(self, config: MCPServerConfig, state_dir: Path | None) -> None:
        self.config = config
        self.errlog: TextIO | None = None
        self.client: Any = None
        self.dead: str | None = None
        self._stop: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        if config.command is not None:
            self.errlog = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
            self._params = dict(
                command=_command(_expand(config.command, state_dir)),
                args=[_expand(a, state_dir) for a in config.args],
                env={k: _expand(v, state_dir) for k, v in (config.env or {}).items()} or None,
                cwd=_expand(config.cwd, state_dir) if config.cwd else None)

    def _transport(self) -> Any:
        from mcp.client.stdio import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client

        if self.config.url is not None:
            return streamable_http_client(self.config.url)
        return stdio_client(StdioServerParameters(**self._params), errlog=self.errlog)  # type: ignore[arg-type]

    def start(self) -> list[Any]:
        """Connect and list every tool (all pages); MCPStartError on any failure."""
        timeout = self.config.start_timeout_s
        try:
            return _run(self._start(timeout), timeout + 10)
        except MCPStartError:
            self.stop()
            raise
        except Exception as exc:  # any failure to come up is the server's, told in one line
            message = f"MCP server {self.config.label!r} did not start: {describe(exc)}"
            self.stop()  # first: the process has exited and its stderr is complete
            raise MCPStartError(message + self.stderr_tail()) from None

    async def _start(self, timeout: float) -> list[Any]:
        ready: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._hold(ready))
        try:
            return await asyncio.wait_for(asyncio.shield(ready), timeout)
        except asyncio.TimeoutError:
            ready.cancel()  # nobody waits for it any more
            raise MCPStartError(f"MCP server {self.config.label!r} did not answer within {timeout:g} s"
                                f"{self.stderr_tail()}") from None

    async def _hold(self, ready: asyncio.Future[list[Any]]) -> None:
        from mcp import ClientSession

        timeout = timedelta(seconds=self.config.call_timeout_s)
        try:
            async with self._transport() as streams, ClientSession(streams[0], streams[1], timeout) as client:
                await client.initialize()
                tools: list[Any] = []
                cursor = None
                for _ in range(100):  # a paginator that never ends cannot hang the start
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.nextCursor
                    if cursor is None:
                        break
                self.client = client
                if not ready.done():
                    ready.set_result(tools)
                assert self._stop is not None
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, or logged
            self.dead = describe(exc)
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(self.dead))
            elif not isinstance(exc, asyncio.CancelledError):
                log.warning("MCP session with %s ended: %s", self.config.label, self.dead)
        finally:
            self.client = None

    def call(self, name: str, args: dict[str, Any]) -> Any:
        """The raw `CallToolResult`; raises TimeoutError, or the SDK's error."""
        timeout = self.config.call_timeout_s
        if self.client is None:
            raise ConnectionError(f"the session has ended ({self.dead or 'closed'})")
        client = self.client

        async def call() -> Any:
            return await asyncio.wait_for(client.call_tool(name, args, timedelta(seconds=timeout)), timeout)
        return _run(call(), timeout + 5)

    def stop(self, timeout: float = 10.0) -> None:
        """End the session: the SDK closes stdin, then terminates and kills the process tree (bounded)."""
        _stop_session(self._stop, self._task, timeout, connected=self.client is not None)
        self._stop = self._task = None

    def discard(self) -> None:
        """Stop, and drop the stderr log."""
        self.stop()
        if self.errlog is not None:
            self.errlog.close()
            self.errlog = None

    def stderr_tail(self) -> str:
        """The end of the server's stderr, as `; server stderr: ...` (empty when there is none)."""
        if self.errlog is None or self.errlog.closed:
            return ""
        try:
            self.errlog.flush()
            self.errlog.seek(0, os.SEEK_END)
            size = self.errlog.tell()
            self.errlog.seek(max(0, size - 4 * STDERR_TAIL))
            text = self.errlog.read().strip()
        except (OSError, ValueError):
            return ""
        return f"; server stderr: ...{text[-STDERR_TAIL:]}" if text else ""


def _stop_session(stop: asyncio.Event | None, task: asyncio.Task[None] | None, timeout: float, *,
                  connected: bool) -> None:
    """Set the stop event and wait for the session task; cancel it if it does not end in time
    (at once when it never connected: it is stuck in the handshake and would not see the event)."""
    if stop is None or task is None or task.done():
        return
    loop = task.get_loop()
    if loop.is_closed():
        return

    async def finish() -> None:
        stop.set()
        if not connected:
            task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            task.cancel()  # the SDK's shutdown is shielded and bounded: the process is killed
            await asyncio.wait({task}, timeout=timeout)
        except BaseException:  # noqa: BLE001 - the session's own failure is already recorded
            pass

    if threading.current_thread() is _loop_thread:  # e.g. garbage collected on the loop: never block it
        loop.create_task(finish())
        return
    try:
        asyncio.run_coroutine_threadsafe(finish(), loop).result(2 * timeout + 5)
    except (concurrent.futures.TimeoutError, RuntimeError) as exc:
        log.warning("an MCP session did not end cleanly: %s", describe(exc))


def describe(exc: BaseException) -> str:
    """One line for an exception (exception groups: their first leaf)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__



@functools.lru_cache(maxsize=1)
def server_errors() -> tuple[type[BaseException], ...]:
    """What the SDK raises for a server's failures (our own bugs are not among them and still raise)."""
    import anyio
    import pydantic
    from mcp.shared.exceptions import McpError

    # RuntimeError: the SDK's "Invalid structured content returned by tool ..." and kin.
    return (McpError, RuntimeError, pydantic.ValidationError, TimeoutError, ConnectionError, OSError,
            anyio.BrokenResourceError, anyio.ClosedResourceError)


REQUEST_TIMEOUT = 408
"""The code of the `McpError` the SDK raises when its per-request read time-out runs out (HTTP's 408)."""


def is_timeout(exc: BaseException) -> bool:
    """Our own wait ran out, or the SDK's per-request one did (McpError with REQUEST_TIMEOUT), whichever came first."""
    from mcp.shared.exceptions import McpError

    return isinstance(exc, TimeoutError) or (isinstance(exc, McpError) and exc.error.code == REQUEST_TIMEOUT)


def server_failure(exc: BaseException, session: Session) -> str:
    text = describe(exc)
    if session.client is None or "closed" in text.lower():
        return f"the server closed the connection (did it crash?): {text}{session.stderr_tail()}"
    return text
