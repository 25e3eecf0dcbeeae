"""The world model as API endpoints (and MCP tools under `serve --mcp`): `rehearse` and `propose`.

Thin: each function loads the shared policy (the Run tab's default model and adapter, cached
by `Services`) and calls `app.engine.world_model.WorldModel`. Bad input comes back as a
`gr.Error`-ready `InputError` message, never a traceback. The docstrings are the MCP tool
descriptions (Gradio reads them), so they speak to the agent that calls the tool.
"""
from __future__ import annotations

import json

from app.config import DEFAULT_MODEL, resolve_adapter
from app.engine.world_model import WorldModel, WorldModelInputError, as_dict
from app.service.forms import InputError
from app.service.session import Services


class WorldModelTools:
    """`rehearse` and `propose` over the shared policy of `model` (default: the embedded agent)."""

    def __init__(self, services: Services, model: str = DEFAULT_MODEL, adapter: str | None = "default") -> None:
        self.services = services
        self.model = model
        self.adapter = resolve_adapter(model, adapter)

    def _world(self) -> WorldModel:
        return WorldModel(self.services.policy(self.model, self.adapter), memory=self.services.memory())

    def rehearse(self, tools: list[dict], history: list[dict], call: dict) -> str:
        """Predict what a tool call will return, before spending the real call.

        The rehearsing model reads the tools, the conversation so far and the call, and writes the
        response it expects, with its confidence. A predicted {"error": ...} means it expects the
        call to fail.

        Args:
            tools: the tools in MCP form (name, description, inputSchema, optional outputSchema) or OpenAI function form (name, description, parameters).
            history: the conversation so far as chat messages: {"role": "user"|"assistant"|"tool", "content": ...}; an assistant message may carry one "tool_calls" entry; a tool message's content is the call's result. May be empty.
            call: the call to rehearse: {"name": <a tool name>, "arguments": {...}}.

        Returns:
            A JSON object: {"call", "predicted" (the expected response), "predicted_text", "valid" (the prediction parsed), "predicts_error", "confidence" (0 to 1), "memory" (the real transitions of the same tool the prediction was conditioned on: arguments, response, source)}.
        """
        try:
            return _json(as_dict(self._world().rehearse(tools, history, call)))
        except WorldModelInputError as exc:
            raise InputError(str(exc)) from None

    def propose(self, tools: list[dict], history: list[dict], k: int = 4) -> str:
        """Propose k candidate tool calls for the next step, each with its rehearsed (predicted) response.

        The acting model proposes k candidates (the greedy one first, then sampled alternatives;
        duplicates folded), the rehearsing model predicts each call's response, and each is scored;
        "chosen" marks the candidate it would commit. Nothing is executed.

        Args:
            tools: the tools in MCP form (name, description, inputSchema, optional outputSchema) or OpenAI function form (name, description, parameters).
            history: the conversation so far as chat messages, ending with the user's request: {"role": "user"|"assistant"|"tool", "content": ...}.
            k: how many candidates, 1 to 8.

        Returns:
            A JSON object: {"candidates": [{"kind" ("call", "answer" or "parse_error"), "action_text", "call", "score", "chosen", "rehearsal"}]}.
        """
        try:
            return _json({"candidates": [as_dict(c) for c in self._world().propose(tools, history, k)]})
        except WorldModelInputError as exc:
            raise InputError(str(exc)) from None


def _json(value: object) -> str:
    """JSON text: what an MCP client reads from the tool's text content (Gradio sends `str(output)`)."""
    return json.dumps(value, ensure_ascii=False, default=str)


__all__ = ["WorldModelTools"]
