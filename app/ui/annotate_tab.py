"""The Annotate tab: review branches where rehearsal and reality diverge, label and correct them."""
from __future__ import annotations

import os

import gradio as gr

from app.service import Services
from app.ui import constants as C
from app.ui import render
from app.ui.annotate_callbacks import AnnotateCallbacks, ReviewQueue
from app.ui.assets import CHEATSHEET, VIEW_CSS


def login_available() -> bool:
    """A Space with `hf_oauth: true` sets OAUTH_CLIENT_ID; the login needs gradio's oauth extra."""
    if not os.environ.get("OAUTH_CLIENT_ID"):
        return False
    try:
        import itsdangerous  # noqa: F401
    except ImportError:
        return False
    return True


def build_annotate_tab(services: Services, tab: gr.Tab) -> gr.Textbox:
    """Returns the annotator field (filled from the Spaces login on page load)."""
    cb = AnnotateCallbacks(services)
    queue = gr.State(ReviewQueue())
    with gr.Column(elem_id=C.ID_ANN_PANEL):
        # First, since Save needs it: a name typed once stays for this browser (`remembered`).
        with gr.Row():
            if login_available():
                gr.LoginButton()
            annotator = gr.Textbox(label="Annotator", placeholder="your name (filled in when signed in)",
                                   elem_id=C.ID_ANN_ANNOTATOR,
                                   info="needed before Save: each annotation is stored with it; remembered in "
                                        "this browser")
        with gr.Row():
            diverged = gr.Checkbox(True, label="Diverged only")
            unannotated = gr.Checkbox(True, label="Unannotated only")
            tool = gr.Dropdown([C.ALL], value=C.ALL, label="Tool")
            episode = gr.Dropdown([C.ALL], value=C.ALL, label="Episode")
            load = gr.Button("Load queue", variant="primary")
        message = gr.HTML("", elem_id=C.ID_ANN_MESSAGE, css_template=VIEW_CSS)
        header = gr.Markdown("Press Load queue.")
        card = gr.HTML(render.branch_cards(None, "Nothing to review yet."), css_template=VIEW_CSS)
        existing = gr.Markdown("")
        with gr.Row():
            prev_btn = gr.Button(C.PREV, elem_id=C.ID_ANN_PREV, size="sm")
            next_btn = gr.Button(C.NEXT, elem_id=C.ID_ANN_NEXT, size="sm")
            help_btn = gr.Button("? Keyboard", size="sm")
        label = gr.Radio(list(C.LABELS), value=None, label="Label (keys 1-5)", elem_id=C.ID_ANN_LABEL)
        with gr.Row():
            corrected_predicted = gr.Code("", language="json", label="Corrected predicted response (JSON)",
                                          interactive=True, lines=6, elem_id=C.ID_ANN_CODE)
            with gr.Column():
                corrected_action = gr.Textbox(label="Corrected action", lines=2,
                                              placeholder='<tool_call>{"name": "...", "arguments": {}}</tool_call>')
                answer = gr.Checkbox(False, label=C.ANN_PLAIN_ANSWER, elem_id=C.ID_ANN_ANSWER,
                                     info="Otherwise the corrected action must call one of this step's tools "
                                          "with valid arguments.")
                note = gr.Textbox(label="Note", lines=2)
                use_actual = gr.Button("Start the correction from the actual response", size="sm")
        save = gr.Button(C.SAVE_NEXT, variant="primary", elem_id=C.ID_ANN_SAVE)
        gr.HTML(CHEATSHEET, elem_id=C.ID_ANN_CHEATSHEET, css_template=VIEW_CSS)

    remembered = gr.BrowserState("", storage_key=C.ANNOTATOR_STORAGE_KEY)
    annotator.change(lambda name: name, annotator, remembered, queue=False, show_progress="hidden",
                     api_visibility="private")
    tab.select(AnnotateCallbacks.remembered_annotator, [remembered, annotator], annotator, queue=False,
               show_progress="hidden", api_visibility="private")
    view = [message, header, card, existing, label, corrected_predicted, corrected_action, note, answer]
    load.click(cb.load_queue, [queue, diverged, unannotated, tool, episode], view, api_name="annotation_queue")
    tab.select(cb.filter_choices, None, [tool, episode], api_visibility="private")
    prev_btn.click(cb.prev, queue, view, api_name="annotate_prev")
    next_btn.click(cb.next, queue, view, api_name="annotate_next")
    save.click(cb.save, [queue, label, corrected_predicted, corrected_action, note, annotator, answer], view,
               api_name="annotate_save")
    use_actual.click(cb.use_actual, queue, corrected_predicted, api_visibility="private")
    help_btn.click(None, js="() => { window.__envaceToggleSheet && window.__envaceToggleSheet(); }")
    return annotator
