"""The Fine-tune tab: train a new adapter on corrected branches and compare it with its parent."""
from __future__ import annotations

from typing import Any, Callable

import gradio as gr

from app.service.finetune import MAX_HELDOUT_ROWS, MAX_REPLAY_RATIO, MAX_UNSEEN_ROWS, WORSE_BY
from app.service import Services, annotated_episode_choices, finetune
from app.ui import constants as C
from app.ui.assets import VIEW_CSS
from app.ui.finetune_callbacks import PREVIEW_COLUMNS, FinetuneCallbacks


def build_finetune_tab(services: Services, tab: gr.Tab, run_adapter: gr.Dropdown,
                       run_adapter_choices: Callable[[], Any]) -> None:
    """`run_adapter` is the Run tab's adapter dropdown: a new adapter is added to its choices."""
    cb = FinetuneCallbacks(services, run_adapter_choices)
    d = C.FT_DEFAULTS
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=300):
            gr.Markdown("**Training data**: annotated branches with a correction (Annotate tab).")
            episodes = gr.Dropdown(annotated_episode_choices(services.store), value=[], multiselect=True,
                                   label="Episodes", info="empty: every episode with annotations")
            annotated = gr.Checkbox(False, label="Also annotated branches without a correction (real response)")
            preview = gr.Button(C.FT_PREVIEW, size="sm")
            with gr.Row():
                steps = gr.Number(d["steps"], label="Max steps", info=f"1-{C.FT_MAX_STEPS}; checkpoints may stop sooner")
                lr = gr.Number(d["lr"], label="Learning rate", info="> 0, at most 1")
                rank = gr.Number(d["rank"], label="LoRA rank", info="1-256 (a parent keeps its own)")
            parent = gr.Dropdown(cb.parent_choices(), value=cb.default_parent(), label="Parent adapter",
                                 info="the adapter to continue; it is only read")
            name = gr.Textbox(finetune.default_name, label="New adapter name",
                              info=f"saved to {finetune.ADAPTER_ROOT}/<name>")
            with gr.Accordion("Before/after measurement", open=False):
                heldout = gr.Number(d["heldout_rows"], label="Held-out rows",
                                    info=f"0-{MAX_HELDOUT_ROWS} rows of held-out BFCL expert traces (0: skip)")
                unseen = gr.Number(d["unseen_rows"], label="Unseen calls per group",
                                   info=f"0-{MAX_UNSEEN_ROWS} real calls never trained on, from held-out expert replays: "
                                        "of the corrected tools, and of the other tools (0: skip)")
                agreement = gr.Checkbox(d["agreement"], label="Generate: Act agreement and Rehearse exact "
                                                              "(a few seconds a row)")
            with gr.Accordion("Advanced: keep the rest (replay, checkpoints)", open=False):
                replay = gr.Number(d["replay_ratio"], label="Replay ratio",
                                   info=f"0-{MAX_REPLAY_RATIO:g} rows of the shipped adapter's own training data "
                                        "(BFCL training split) per correction row, against forgetting (0: none)")
                eval_every = gr.Number(d["eval_every"], label="Evaluate every N steps",
                                       info="checkpoints on training-split validation calls: stop when the corrected "
                                            "tools stop improving or the others get worse, keep the best (0: off)")
                gr.Markdown(f"The new adapter becomes the default (the Run tab's and the next parent) only when "
                            f"its Rehearse exact on the other tools' unseen calls falls by at most {WORSE_BY:g}.")
            run = gr.Button(C.FT_RUN, variant="primary")
        with gr.Column(scale=3):
            message = gr.HTML("", elem_id=C.ID_FT_MESSAGE, css_template=VIEW_CSS)
            summary = gr.Markdown("Open this tab or press Preview data to see what a fine-tune would train on.")
            table = gr.Dataframe(headers=PREVIEW_COLUMNS, value=[], interactive=False, wrap=True, max_height=260,
                                 label="Branches to train on")
            status = gr.Markdown("")
            loss = gr.Plot(finetune.loss_figure([]), label="Training loss")
            # Stacked, full width: the table's last column (the change) stays on screen.
            comparison = gr.Dataframe(headers=finetune.COMPARISON_COLUMNS, value=[], interactive=False, wrap=True,
                                      label="Before / after")
            comparison_figure = gr.Plot(finetune.comparison_figure({}), label="Before / after")

    data = [episodes, annotated]
    plan_view = [message, summary, table]
    preview.click(cb.preview, data, plan_view, api_name="finetune_preview")
    for trigger in (episodes.input, annotated.input):
        trigger(cb.show_plan, data, plan_view, api_visibility="private")
    tab.select(cb.refresh, None, [episodes, parent], api_visibility="private").then(
        cb.show_plan, data, plan_view, api_visibility="private")
    # Its own concurrency group, two slots: a second press reaches the callback at once and is
    # told that a fine-tune is running (one at a time, enforced by app.service.finetune).
    run.click(cb.run, [*data, steps, lr, rank, parent, name, heldout, agreement, unseen, replay, eval_every],
              [message, status, loss, comparison, comparison_figure, parent, name, run_adapter],
              api_name="finetune", concurrency_id="finetune", concurrency_limit=2)
