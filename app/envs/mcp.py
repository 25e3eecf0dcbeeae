"""MCP environments: the tools of a Model Context Protocol server behind the Environment protocol.

Contract:
- `MCPServerConfig` is the format MCP clients use: `{"command": ..., "args": [...], "env": {...}}`
  (stdio; `cwd` too) or `{"url": ...}` (streamable HTTP). In `command`, `args`, `env` and `cwd`,
  `{state}` stands for the environment's state folder and `{servers}` for the folder that
  `make mcp-deps` fills (`<repo>/.mcp`, or `$ENVACE_MCP_DIR`). A command that is not on PATH is
  also looked for beside the running Python (the virtual environment's `bin/`).
- `MCPEnvironment.start(config, state_dir=...)` connects and lists the tools; a server that
  cannot start, exits, or does not answer in time raises `MCPStartError` (with the tail of its
  stderr). Tools keep their `inputSchema`; `outputSchema`, where given, becomes `Tool.response`
  (else the `{"text": ...}` shape below). `Tool.read_only` is `readOnlyHint` (a `destructiveHint`
  of true overrides it), or the config's `read_only_tools` for servers without annotations.
- `call()` never raises for bad input or server trouble: an unknown tool, arguments that fail the
  input schema, an error result, a time-out, a crashed server, or a malformed result all come back
  as `ToolResult(error=True, output={"error": ...})`. A result is its `structuredContent` when the
  server gives one, else `{"text": <the text blocks joined>}` (other blocks are summarised, never
  inlined as base64).
- `forkable` is True for a stdio server with a state folder: `fork()` copies the folder and starts a
  fresh server process on the copy, and the fork answers as the original would (the original's
  folder path in arguments and results is translated to and from the copy's). Any other server
  (HTTP, or stdio without a state folder) is not forkable: `fork()` opens a second session on the
  same backend, and the engine shadow-executes only read-only tools there.
- `close()` ends the session and the server process (also on garbage collection and at exit);
  a closed environment answers calls with an error result.
- The SDK is asyncio; the protocol is synchronous. One event-loop thread per process runs every
  session; each session lives in its own task (the SDK's context managers are entered and left in
  that task), and every wait on it has a time-out.
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
import weakref
from pathlib import Path
from typing import Any, TextIO

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.envs.base import Tool, ToolResult
from app.envs.mcp_state import folder_state

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXT_RESPONSE: dict[str, Any] = {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
"""`Tool.response` of a tool without an `outputSchema`: its result is `{"text": ...}`."""
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


class _Session:
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
        except BaseException as exc:  # any failure to come up is the server's, told in one line
            message = f"MCP server {self.config.label!r} did not start: {_describe(exc)}"
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
        from mcp import Client

        try:
            async with Client(self._transport(), read_timeout_seconds=self.config.call_timeout_s) as client:
                tools: list[Any] = []
                cursor = None
                for _ in range(100):  # a paginator that never ends cannot hang the start
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.next_cursor
                    if cursor is None:
                        break
                self.client = client
                if not ready.done():
                    ready.set_result(tools)
                assert self._stop is not None
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, or logged
            self.dead = _describe(exc)
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
            return await asyncio.wait_for(client.call_tool(name, args, read_timeout_seconds=timeout), timeout)
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
        log.warning("an MCP session did not end cleanly: %s", _describe(exc))


def _describe(exc: BaseException) -> str:
    """One line for an exception (exception groups: their first leaf)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---------------------------------------------------------------- the environment


class MCPEnvironment:
    """The tools of one MCP server; see the module docstring for the contract."""

    def __init__(self, config: MCPServerConfig, *, state_dir: Path | None = None, owns_state: bool = False,
                 view_root: Path | None = None, name: str = "mcp") -> None:
        """Use `start()`; this only records the settings."""
        self.config = config
        self.name = name
        """Shown as `Tool.env_class` and as the key of `state()`."""
        self.state_dir = state_dir.resolve() if state_dir is not None else None
        self._view_root = view_root.resolve() if view_root is not None else self.state_dir
        self.forkable = config.command is not None and state_dir is not None
        self.turn = 0
        self._tools: dict[str, Tool] = {}
        self._validators: dict[str, jsonschema.protocols.Validator] = {}
        self._session = _Session(config, self.state_dir)
        cleanup_dir = self.state_dir if owns_state else None
        self._finalizer = weakref.finalize(self, _close, self._session, cleanup_dir)

    @classmethod
    def start(cls, config: MCPServerConfig | dict[str, Any], *, state_dir: Path | str | None = None,
              owns_state: bool = False, name: str = "mcp", view_root: Path | None = None) -> MCPEnvironment:
        """Start (or connect to) the server and list its tools. `owns_state`: delete the folder on close."""
        config = config if isinstance(config, MCPServerConfig) else MCPServerConfig.model_validate(config)
        env = cls(config, state_dir=Path(state_dir) if state_dir is not None else None, owns_state=owns_state,
                  view_root=view_root, name=name)
        try:
            tools = env._session.start()
        except MCPStartError:
            env.close()
            raise
        env._tools = {t.name: _tool(t, name, config.read_only_tools) for t in tools}
        return env

    # -- tools -------------------------------------------------------------

    def set_turn(self, turn: int) -> None:
        """Enter user turn `turn`; an MCP server's tools do not change with the turn."""
        self.turn = turn

    def tools(self) -> list[Tool]:
        return list(self._tools.values())

    def get_tool(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def param_names(self, tool_name: str) -> list[str]:
        tool = self._tools.get(tool_name)
        return list(tool.parameters.get("properties", {})) if tool else []

    # -- the call boundary -------------------------------------------------

    def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        """Execute one call on the server; every failure comes back as an error result."""
        tool = self._tools.get(name)
        if tool is None:
            return _error(f"unknown tool {name!r}; this server has: {', '.join(self._tools) or 'none'}")
        if not isinstance(args, dict):
            return _error(f"arguments of {name} must be an object, got {type(args).__name__}")
        problems = sorted(self._validator(tool).iter_errors(args), key=lambda e: list(e.path))
        if problems:
            text = "; ".join(f"{'.'.join(map(str, e.path)) or '(arguments)'}: {e.message}" for e in problems)
            return _error(f"invalid arguments for {name}: {text}")
        if not self._finalizer.alive:
            return _error("this MCP environment is closed")
        try:
            raw = self._session.call(name, self._translate(args, inbound=True))
        except _server_errors() as exc:  # the server's failure: crash, protocol error, bad result, time-out
            if _is_timeout(exc):
                return _error(f"{name} did not answer within {self.config.call_timeout_s:g} s (time-out)")
            return _error(f"{name} failed: {_server_failure(exc, self._session)}")
        try:
            output, is_error = _output(raw)
        except (TypeError, ValueError, AttributeError) as exc:
            return _error(f"{name} returned a malformed result: {_describe(exc)}")
        return ToolResult(self._translate(output, inbound=False), error=is_error)

    def _validator(self, tool: Tool) -> jsonschema.protocols.Validator:
        if tool.name not in self._validators:
            cls = jsonschema.validators.validator_for(tool.parameters, default=jsonschema.Draft202012Validator)
            self._validators[tool.name] = cls(tool.parameters)
        return self._validators[tool.name]

    def _translate(self, value: Any, *, inbound: bool) -> Any:
        """On a fork, the original's folder path in arguments -> the copy's, and back in results."""
        if self.state_dir is None or self._view_root is None or self.state_dir == self._view_root:
            return value
        old, new = (str(self._view_root), str(self.state_dir)) if inbound else (str(self.state_dir), str(self._view_root))
        if isinstance(value, str):
            return value.replace(old, new)
        if isinstance(value, list):
            return [self._translate(v, inbound=inbound) for v in value]
        if isinstance(value, dict):
            return {k: self._translate(v, inbound=inbound) for k, v in value.items()}
        return value

    # -- state -------------------------------------------------------------

    def fork(self) -> MCPEnvironment:
        """A fresh server on a copy of the state folder (forkable), else a second session on the same backend."""
        if not self._finalizer.alive:
            raise RuntimeError("cannot fork a closed MCP environment")
        if not self.forkable:
            return MCPEnvironment.start(self.config, state_dir=self.state_dir, name=self.name)
        assert self.state_dir is not None
        copy_root = Path(tempfile.mkdtemp(prefix="envace-mcp-fork-"))
        copy = copy_root / self.state_dir.name
        shutil.copytree(self.state_dir, copy, symlinks=True)
        try:
            fork = MCPEnvironment.start(self.config, state_dir=copy, owns_state=False, name=self.name,
                                        view_root=self._view_root)
        except MCPStartError:
            shutil.rmtree(copy_root, ignore_errors=True)
            raise
        fork._finalizer.detach()
        fork._finalizer = weakref.finalize(fork, _close, fork._session, copy_root)
        fork.turn = self.turn
        return fork

    def state(self) -> dict[str, Any]:
        """The state folder's files (Git and SQLite summarised), by environment name; `{}` without one."""
        if self.state_dir is None:
            return {self.name: {}}
        return {self.name: folder_state(self.state_dir)}

    def close(self) -> None:
        """End the session and the server process; delete an owned state folder. Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> MCPEnvironment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close(session: _Session, cleanup_dir: Path | None) -> None:
    session.discard()
    if cleanup_dir is not None:
        shutil.rmtree(cleanup_dir, ignore_errors=True)


@functools.lru_cache(maxsize=1)
def _server_errors() -> tuple[type[BaseException], ...]:
    """What the SDK raises for a server's failures (our own bugs are not among them and still raise)."""
    import anyio
    import pydantic
    from mcp.shared.exceptions import MCPError

    # RuntimeError: the SDK's "Invalid structured content returned by tool ..." and kin.
    return (MCPError, RuntimeError, pydantic.ValidationError, TimeoutError, ConnectionError, OSError,
            anyio.BrokenResourceError, anyio.ClosedResourceError)


def _is_timeout(exc: BaseException) -> bool:
    """Our own wait ran out, or the SDK's per-request one did (MCPError REQUEST_TIMEOUT), whichever came first."""
    from mcp.shared.exceptions import MCPError
    from mcp.types import REQUEST_TIMEOUT

    return isinstance(exc, TimeoutError) or (isinstance(exc, MCPError) and exc.code == REQUEST_TIMEOUT)


def _error(message: str) -> ToolResult:
    return ToolResult({"error": message}, error=True)


def _server_failure(exc: BaseException, session: _Session) -> str:
    text = _describe(exc)
    if session.client is None or "closed" in text.lower():
        return f"the server closed the connection (did it crash?): {text}{session.stderr_tail()}"
    return text


def _tool(raw: Any, env_name: str, read_only_tools: list[str]) -> Tool:
    """Our Tool from the SDK's: schemas kept, read-only from the hints (or the config's list)."""
    hints = raw.annotations
    read_only = bool(hints and hints.read_only_hint is True and hints.destructive_hint is not True)
    return Tool(name=raw.name, description=(raw.description or raw.title or "").strip(),
                parameters=dict(raw.input_schema or {"type": "object", "properties": {}}),
                response=dict(raw.output_schema) if raw.output_schema else dict(TEXT_RESPONSE),
                read_only=read_only or raw.name in read_only_tools, env_class=env_name)


def _output(raw: Any) -> tuple[Any, bool]:
    """(JSON-able output, is_error) from a `CallToolResult`; ValueError when it is not one."""
    from mcp.types import CallToolResult, TextContent

    if not isinstance(raw, CallToolResult):
        raise ValueError(f"expected a CallToolResult, got {type(raw).__name__}")
    texts = [b.text for b in raw.content if isinstance(b, TextContent)]
    others = [_summary(b) for b in raw.content if not isinstance(b, TextContent)]
    if raw.is_error:
        return {"error": "\n".join(texts) or "the tool reported an error"}, True
    if raw.structured_content is not None:
        return raw.structured_content, False
    output: dict[str, Any] = {"text": "\n".join(texts)}
    if others:
        output["other_content"] = others
    return output, False


def _summary(block: Any) -> dict[str, Any]:
    """A non-text content block without its payload (no base64 in prompts)."""
    data = block.model_dump(mode="json", by_alias=True, exclude_none=True)
    for key in ("data", "blob"):
        if isinstance(data.get(key), str):
            data[key] = f"<{len(data[key])} base64 characters>"
    resource = data.get("resource")
    if isinstance(resource, dict) and isinstance(resource.get("blob"), str):
        resource["blob"] = f"<{len(resource['blob'])} base64 characters>"
    return data


__all__ = ["MCPEnvironment", "MCPServerConfig", "MCPStartError", "TEXT_RESPONSE", "servers_dir"]
