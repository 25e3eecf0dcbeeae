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
  input schema, an error result (`isError`, or a text result starting with one of the config's
  `error_prefixes`), a time-out, a crashed server, or a malformed result all come back as
  `ToolResult(error=True, output={"error": ...})`. A result is its `structuredContent` when the
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
  that task), and every wait on it has a time-out (`app/envs/mcp_client.py`).
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import jsonschema

from app.envs.base import Tool, ToolResult, ToolTable, argument_problems
from app.envs.mcp_client import (MCPServerConfig, MCPStartError, Session, describe, is_timeout, server_errors,
                                 server_failure, servers_dir)
from app.envs.mcp_state import folder_state

TEXT_RESPONSE: dict[str, Any] = {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
"""`Tool.response` of a tool without an `outputSchema`: its result is `{"text": ...}`."""


# ---------------------------------------------------------------- the environment


class MCPEnvironment(ToolTable):
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
        self._session = Session(config, self.state_dir)
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

    # -- the call boundary (tools(), get_tool, param_names, set_turn: ToolTable) -- -------------------------------------------------

    def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        """Execute one call on the server; every failure comes back as an error result."""
        tool = self._tools.get(name)
        if tool is None:
            return _error(f"unknown tool {name!r}; this server has: {', '.join(self._tools) or 'none'}")
        if not isinstance(args, dict):
            return _error(f"arguments of {name} must be an object, got {type(args).__name__}")
        problems = argument_problems(self._validator(tool), args)
        if problems:
            return _error(f"invalid arguments for {name}: {problems}")
        if not self._finalizer.alive:
            return _error("this MCP environment is closed")
        try:
            raw = self._session.call(name, self._translate(args, inbound=True))
        except server_errors() as exc:  # the server's failure: crash, protocol error, bad result, time-out
            if is_timeout(exc):
                return _error(f"{name} did not answer within {self.config.call_timeout_s:g} s (time-out)")
            return _error(f"{name} failed: {server_failure(exc, self._session)}")
        try:
            output, is_error = _output(raw, self.config.error_prefixes)
        except (TypeError, ValueError, AttributeError) as exc:
            return _error(f"{name} returned a malformed result: {describe(exc)}")
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


def _close(session: Session, cleanup_dir: Path | None) -> None:
    session.discard()
    if cleanup_dir is not None:
        shutil.rmtree(cleanup_dir, ignore_errors=True)


def _error(message: str) -> ToolResult:
    return ToolResult({"error": message}, error=True)


def _tool(raw: Any, env_name: str, read_only_tools: list[str]) -> Tool:
    """Our Tool from the SDK's: schemas kept, read-only from the hints (or the config's list)."""
    hints = raw.annotations
    read_only = bool(hints and hints.readOnlyHint is True and hints.destructiveHint is not True)
    return Tool(name=raw.name, description=(raw.description or raw.title or "").strip(),
                parameters=dict(raw.inputSchema or {"type": "object", "properties": {}}),
                response=dict(raw.outputSchema) if raw.outputSchema else dict(TEXT_RESPONSE),
                read_only=read_only or raw.name in read_only_tools, env_class=env_name)


def _output(raw: Any, error_prefixes: list[str]) -> tuple[Any, bool]:
    """(JSON-able output, is_error) from a `CallToolResult`; ValueError when it is not one."""
    from mcp.types import CallToolResult, TextContent

    if not isinstance(raw, CallToolResult):
        raise ValueError(f"expected a CallToolResult, got {type(raw).__name__}")
    texts = [b.text for b in raw.content if isinstance(b, TextContent)]
    others = [_summary(b) for b in raw.content if not isinstance(b, TextContent)]
    text = "\n".join(texts)
    failed_as_text = bool(error_prefixes) and raw.structuredContent is None and text.startswith(tuple(error_prefixes))
    if raw.isError or failed_as_text:
        return {"error": text or "the tool reported an error"}, True
    if raw.structuredContent is not None:
        return raw.structuredContent, False
    output: dict[str, Any] = {"text": text}
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
