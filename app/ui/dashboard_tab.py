"""The Dashboard tab: fidelity, divergence, success, calibration and annotation figures."""
from __future__ import annotations

import gradio as gr

from app.service import Services
from app.ui import constants as C
from app.ui.assets import VIEW_CSS
from app.ui.dashboard_callbacks import DashboardCallbacks


def build_dashboard_tab(services: Services, tab: gr.Tab) -> None:
    cb = DashboardCallbacks(services)
    with gr.Row():
        model = gr.Dropdown([C.ALL], value=C.ALL, label="Model")
        adapter = gr.Dropdown([C.ALL], value=C.ALL, label="Adapter")
        mode = gr.Dropdown([C.ALL] + list(C.MODES), value=C.ALL, label="Mode")
        since = gr.Textbox(label="From (YYYY-MM-DD)")
        until = gr.Textbox(label="To (YYYY-MM-DD)")
        refresh = gr.Button("Refresh", variant="primary")
    message = gr.HTML("", css_template=VIEW_CSS)
    with gr.Row():
        fidelity = gr.Plot(label="Fidelity by tool")
        divergence = gr.Plot(label="Divergence by step")
    with gr.Row():
        success = gr.Plot(label="Success and external calls by mode")
        calibration = gr.Plot(label="Selector calibration")
    labels = gr.Plot(label="Annotations by label")

    inputs = [model, adapter, mode, since, until]
    outputs = [message, fidelity, divergence, success, calibration, labels]
    refresh.click(cb.figures, inputs, outputs, api_name="dashboard")
    tab.select(cb.filter_choices, None, [model, adapter], api_visibility="private").then(
        cb.figures, inputs, outputs, api_visibility="private")
