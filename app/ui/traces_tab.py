"""The Traces tab: stored episodes in a table, one replayed read-only, two side by side."""
from __future__ import annotations

from typing import Any

import gradio as gr

from app.service import Services
from app.ui import constants as C
from app.ui import render
from app.ui.assets import VIEW_CSS
from app.ui.traces_callbacks import RehearseCallbacks, TracesCallbacks


def build_traces_tab(services: Services, tab: gr.Tab, run: dict[str, Any], tabs: gr.Tabs) -> None:
    """`run`: the Run tab's session, form and views (an unfinished episode continues there)."""
    cb = TracesCallbacks(services)
    opened = gr.State(None)  # the episode being replayed (this session only)
    with gr.Row():
        task = gr.Textbox(label="Task contains", placeholder="e.g. multi_turn_base_1")
        env_class = gr.Dropdown([C.ALL] + services.catalog.env_classes, value=C.ALL, label="Environment class")
        mode = gr.Dropdown([C.ALL] + list(C.MODES), value=C.ALL, label="Mode")
        model = gr.Dropdown([C.ALL], value=C.ALL, label="Model")
        adapter = gr.Dropdown([C.ALL], value=C.ALL, label="Adapter")
        success = gr.Dropdown(list(C.SUCCESS_CHOICES), value=C.ALL, label="Success")
        since = gr.Textbox(label="From (YYYY-MM-DD)")
        until = gr.Textbox(label="To (YYYY-MM-DD)")
    refresh = gr.Button("Search episodes", variant="primary")
    message = gr.HTML("", css_template=VIEW_CSS, elem_id=C.ID_TRACES_MESSAGE)
    table = gr.Dataframe(headers=render.EPISODE_COLUMNS, value=[], interactive=False, wrap=True,
                         label="Episodes (newest first)", max_height=320, elem_id=C.ID_TRACES_TABLE,
                         column_widths=render.EPISODE_COLUMN_WIDTHS)
    with gr.Accordion("Replay one episode (read-only)", open=True):
        with gr.Row():
            episode_id = gr.Dropdown([], label="Episode", allow_custom_value=True, scale=2)
            open_btn = gr.Button("Open", scale=1)
            continue_btn = gr.Button(C.CONTINUE, scale=1)
            discard_btn = gr.Button(C.DISCARD, scale=1, variant="stop")
        # Discard asks first, naming what it would delete (`ask_discard`); only "Delete it" deletes.
        pending_discard = gr.State(None)
        listed_note = gr.State("")  # the relisting after a delete keeps the "discarded" message in view
        with gr.Group(visible=False) as confirm_box:
            confirm_text = gr.Markdown(elem_id=C.ID_DISCARD_CONFIRM)
            with gr.Row():
                confirm_btn = gr.Button(C.DISCARD_CONFIRM, variant="stop")
                keep_btn = gr.Button(C.DISCARD_CANCEL)
        status = gr.Markdown(elem_id=C.ID_TRACES_STATUS)
        step_picker = gr.Slider(0, 1, value=0, step=1, label="Step", interactive=False)
        # The cards get the wider column (a card's fork-diff table needs about 560 px at 1400 px), in columns
        # of their own: an HTML output's own scale did not hold, and the chat took two thirds.
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=360):
                chat = gr.Chatbot(label="Conversation up to this step", height=480)
            with gr.Column(scale=3, min_width=560):
                cards = gr.HTML(render.branch_cards(None, "Open an episode."), css_template=VIEW_CSS,
                                elem_id=C.ID_TRACES_CARDS)
        state_view = gr.HTML(render.state_view(None), css_template=VIEW_CSS)
    with gr.Accordion("Compare two episodes", open=False):
        with gr.Row():
            left = gr.Dropdown([], label="Episode A", allow_custom_value=True)
            right = gr.Dropdown([], label="Episode B", allow_custom_value=True)
            compare_btn = gr.Button("Compare")
        comparison = gr.HTML("", css_template=VIEW_CSS)
    with gr.Accordion("Import / export episodes (JSONL)", open=False):
        with gr.Row(equal_height=False):
            with gr.Column():
                upload = gr.File(label=f"Episodes file to import (.jsonl, at most {C.MAX_IMPORT_MB} MiB)",
                                 file_types=[".jsonl"], type="filepath", elem_id=C.ID_TRACES_UPLOAD)
                skip_existing = gr.Checkbox(False, label="Skip episodes already in the database")
                import_btn = gr.Button(C.IMPORT)
            with gr.Column():
                export_btn = gr.Button(C.EXPORT_LISTED)
                download = gr.File(label="Exported episodes", interactive=False)
        io_message = gr.HTML("", css_template=VIEW_CSS, elem_id=C.ID_TRACES_IO_MESSAGE)

    foreign = build_foreign_traces(cb)
    filters = [task, env_class, mode, model, adapter, success, since, until]
    listed = refresh.click(cb.list_episodes, filters, [table, message, episode_id], api_name="list_episodes")
    listed.then(cb.filter_choices, None, [model, adapter, left, right], api_visibility="private")
    tab.select(cb.list_episodes, filters, [table, message, episode_id], api_visibility="private").then(
        cb.filter_choices, None, [model, adapter, left, right], api_visibility="private")
    open_btn.click(cb.open_episode, episode_id, [message, opened, status, step_picker, chat, cards, state_view],
                   api_name="open_episode")
    table.select(cb.select_row, [table], episode_id, api_visibility="private").then(
        cb.open_episode, episode_id, [message, opened, status, step_picker, chat, cards, state_view],
        api_visibility="private")
    names = list(run["form"])
    continue_btn.click(lambda episode, session: cb.continue_episode(episode, session, names),
                       [episode_id, run["session"]], [message, *run["form"].values(), *run["outputs"], tabs],
                       api_visibility="private")
    discard_btn.click(cb.ask_discard, episode_id, [message, pending_discard, confirm_box, confirm_text],
                      api_visibility="private")
    keep_btn.click(cb.keep_episode, pending_discard, [message, pending_discard, confirm_box], api_visibility="private")
    confirm_btn.click(cb.discard_episode, pending_discard, [message, pending_discard, confirm_box],
                      api_visibility="private").then(
        cb.list_episodes, filters, [table, listed_note, episode_id], api_visibility="private")
    # Another episode picked: the question about the last one is withdrawn.
    episode_id.input(lambda: (None, gr.Group(visible=False)), None, [pending_discard, confirm_box],
                     api_visibility="private")
    step_picker.change(cb.show_step, [opened, step_picker], [chat, cards, state_view], api_name="replay_step")
    compare_btn.click(cb.compare, [left, right], comparison, api_name="compare_episodes")
    import_btn.click(cb.import_file, [upload, skip_existing], io_message, api_name="import_episodes").then(
        cb.list_episodes, filters, [table, message, episode_id], api_visibility="private")
    export_btn.click(cb.export_listed, table, [download, io_message], api_name="export_episodes")
    wire_foreign_traces(cb, foreign, table, filters, [table, message, episode_id])
    build_rehearse_section(services, tab)


# ---------------------------------------------------------------- another agent's traces (issue 37, parts 1 and 6)


def build_foreign_traces(cb: TracesCallbacks) -> dict[str, Any]:
    """The accordion that imports another agent's traces (chat JSONL, OTLP/JSON) and exports OTLP/JSON."""
    with gr.Accordion("Import your own agent's traces (OpenAI chat JSONL, OpenTelemetry OTLP/JSON)", open=False):
        with gr.Row(equal_height=False):
            with gr.Column():
                fmt = gr.Radio(list(C.TRACE_FORMAT_CHOICES), value="openai", label="Format")
                upload = gr.File(label=f"Trace file (.jsonl or .json, at most {C.MAX_IMPORT_MB} MiB)",
                                 file_types=[".jsonl", ".json"], type="filepath", elem_id=C.ID_TRACES_FOREIGN_UPLOAD)
                skip = gr.Checkbox(False, label="Skip traces already imported")
                import_btn = gr.Button(C.IMPORT_TRACES)
            with gr.Column():
                export_btn = gr.Button(C.EXPORT_OTLP)
                download = gr.File(label="Exported traces (OTLP/JSON)", interactive=False)
        message = gr.HTML("", css_template=VIEW_CSS, elem_id=C.ID_TRACES_FOREIGN_MESSAGE)
    return {"format": fmt, "upload": upload, "skip": skip, "import": import_btn, "export": export_btn,
            "download": download, "message": message}


def wire_foreign_traces(cb: TracesCallbacks, ui: dict[str, Any], table: Any, filters: list[Any],
                        listing: list[Any]) -> None:
    ui["import"].click(cb.import_traces, [ui["upload"], ui["format"], ui["skip"]], ui["message"],
                       api_name="import_traces").then(cb.list_episodes, filters, listing, api_visibility="private")
    ui["export"].click(cb.export_listed_otlp, table, [ui["download"], ui["message"]], api_name="export_otlp")


# ---------------------------------------------------------------- rehearse with a model / compare world models


def build_rehearse_section(services: Services, tab: gr.Tab) -> None:
    """Issue 37: rehearse stored episodes with a world model (teacher-forced on their recorded history), and
    compare world models on the same episodes per tool, the calls where they disagree side by side."""
    from app.config import shipped_adapter
    from app.service.model_comparison import TABLE_COLUMNS

    cb = RehearseCallbacks(services)
    with gr.Accordion("Rehearse with a model", open=False):
        gr.Markdown("For each recorded call, the model predicts the response from the recorded history; predicted "
                    "versus actual is stored as a new episode (the same model again replaces it), to annotate, "
                    "chart and fine-tune on. Alternatives: calls the model would have made there (never executed).")
        with gr.Row():
            episodes = gr.Dropdown([], multiselect=True, label="Episodes", allow_custom_value=True, scale=3,
                                   elem_id=C.ID_REHEARSE_EPISODES)
            model = gr.Dropdown([C.DEFAULT_MODEL], value=C.DEFAULT_MODEL, allow_custom_value=True, label="Model",
                                info="embedded | hf:<id or path> | gguf:<path> | openai:<base_url>#<model>", scale=2)
            adapter = gr.Dropdown([C.NO_ADAPTER] + services.adapters(), value=shipped_adapter() or C.NO_ADAPTER,
                                  allow_custom_value=True, label="Adapter (LoRA)", scale=2)
            alternatives = gr.Number(0, minimum=0, maximum=8, precision=0, label="Alternatives (K)", scale=1)
        rehearse_btn = gr.Button(C.REHEARSE, variant="primary")
        rehearse_message = gr.HTML("", css_template=VIEW_CSS, elem_id=C.ID_REHEARSE_MESSAGE)
    with gr.Accordion("Compare world models", open=False):
        with gr.Row():
            compare_episodes = gr.Dropdown([], multiselect=True, label="Episodes (rehearsed by every model)",
                                           allow_custom_value=True, scale=3)
            models = gr.Textbox("embedded,embedded@none", label="Models (SPEC[@ADAPTER], separated by commas)",
                                scale=3)
            compare_btn = gr.Button(C.COMPARE_MODELS, scale=1)
        compare_message = gr.HTML("", css_template=VIEW_CSS)
        fidelity = gr.Dataframe(headers=TABLE_COLUMNS, value=[], interactive=False, label="Fidelity per tool and model")
        figure = gr.Plot(label="Fidelity per tool and model")
        comparison = gr.State(None)
        disagreement = gr.Dropdown([], label="Calls where the models disagree")
        side_by_side = gr.HTML("", css_template=VIEW_CSS, elem_id=C.ID_MODELS_SIDE_BY_SIDE)
    tab.select(cb.choices, None, [episodes, compare_episodes], api_visibility="private")
    rehearse_btn.click(cb.rehearse, [episodes, model, adapter, alternatives], rehearse_message,
                       api_name="rehearse_episodes").then(cb.choices, None, [episodes, compare_episodes],
                                                          api_visibility="private")
    compare_btn.click(cb.compare, [compare_episodes, models],
                      [fidelity, figure, compare_message, disagreement, comparison], api_name="compare_models")
    # A new comparison's first disagreement (picked by `compare`) opens through the picker's change too.
    disagreement.change(cb.open_disagreement, [comparison, disagreement], side_by_side, api_name="open_disagreement")
