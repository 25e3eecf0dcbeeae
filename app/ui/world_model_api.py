"""`rehearse` and `propose` as API endpoints (MCP tools under `serve --mcp`); the work is in
`app.service.world_model`. An `InputError` becomes a `gr.Error`, whose message reaches the
client (an MCP client sees it as the tool's error)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import gradio as gr

from app.service import InputError, Services
from app.service.world_model import WorldModelTools

ENDPOINTS = ("rehearse", "propose")


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)  # keeps the name, docstring and type hints Gradio turns into the tool's schema
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except InputError as exc:
            raise gr.Error(str(exc)) from None
    return call


def register_world_model(services: Services) -> None:
    """Add the endpoints to the Blocks being built (call inside its `with`)."""
    tools = WorldModelTools(services)
    for name in ENDPOINTS:
        gr.api(_user_errors(getattr(tools, name)), api_name=name)


def only_world_model_public(demo: gr.Blocks) -> None:
    """Under `serve --mcp`: every other endpoint becomes undocumented (still callable by the UI and
    by clients, but not listed), so an MCP client sees exactly `rehearse` and `propose`."""
    for fn in demo.fns.values():
        if fn.api_visibility == "public" and fn.api_name not in ENDPOINTS:
            fn.api_visibility = "undocumented"
