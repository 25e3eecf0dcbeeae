"""Callbacks of the Dashboard tab: read the filters, build the figures (app.service.dashboard)."""
from __future__ import annotations

from typing import Any

import gradio as gr

from app.service import dashboard
from app.service import InputError, Services
from app.ui import constants as C
from app.ui.run_callbacks import message_html
from app.ui.traces_callbacks import choice, date_filter


class DashboardCallbacks:
    def __init__(self, services: Services) -> None:
        self.services = services

    def filter_choices(self) -> tuple[Any, Any]:
        store = self.services.store
        return (gr.Dropdown(choices=[C.ALL] + store.episode_values("model")),
                gr.Dropdown(choices=[C.ALL] + store.episode_values("adapter")))

    def figures(self, model: str, adapter: str, mode: str, since: str, until: str) -> tuple[Any, ...]:
        try:
            filters = {"model": choice(model), "adapter": choice(adapter), "mode": choice(mode),
                       "since": date_filter(since, "From"), "until": date_filter(until, "To")}
        except InputError as exc:
            return (message_html(str(exc), "error"),) + (gr.skip(),) * 5
        return ("", *dashboard.figures(self.services.store, **filters))
