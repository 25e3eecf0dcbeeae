"""The Run tab: pick a task and settings, step the agent, inspect every branch of a step."""
from __future__ import annotations

import gradio as gr


from app.service import ENV_CLASSES, RunSession, Services, forms
from app.ui import constants as C
from app.ui import render
from app.ui.assets import VIEW_CSS
from app.ui.run_callbacks import RunCallbacks


def build_run_tab(services: Services) -> dict[str, gr.components.Component]:
    """Layout and wiring of the Run tab; returns the components other tabs or the page load need."""
    cb = RunCallbacks(services)
    d = C.UI_DEFAULTS
    # Deep-copied per browser session (RunSession.__deepcopy__); when Gradio drops a closed
    # session's state, its open episode is saved as stopped rather than left "running".
    session = gr.State(RunSession(), delete_callback=lambda run: run.close(services))
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=280):
            source = gr.Radio(list(C.SOURCES), value=C.SOURCE_TASK, label="What to run")
            with gr.Group() as task_group:
                env_filter = gr.Dropdown([C.ALL] + services.catalog.env_classes, value=C.ALL,
                                         label="Filter: environment class")
                category_filter = gr.Dropdown([C.ALL] + services.catalog.categories, value=C.ALL,
                                              label="Filter: category")
                task_search = gr.Textbox(label="Search tasks", elem_id=C.ID_TASK_SEARCH, max_lines=1,
                                         placeholder="e.g. twitter, post_tweet, airline",
                                         info="ids, environments, tool names and every user turn")
                task = gr.Dropdown(cb.task_choices(C.ALL, C.ALL), value=C.DEFAULT_TASK, filterable=True,
                                   allow_custom_value=True,  # unknown ids get our message, not a list of 800
                                   label="Task", info=C.TASK_LIST_INFO,
                                   elem_classes=[C.CLASS_FULL_ON_HOVER])
            with gr.Group(visible=False) as instruction_group:
                instruction_env = gr.Dropdown(list(ENV_CLASSES), value=C.DEFAULT_INSTRUCTION_ENV,
                                              label="Environment for the instruction")
                instruction = gr.Textbox(label="Instruction", lines=3,
                                         placeholder="e.g. List the files in the current directory.")
            model = gr.Dropdown([C.DEFAULT_MODEL], value=C.DEFAULT_MODEL, allow_custom_value=True, label="Model",
                                info="embedded | hf:<id or path> | gguf:<path> | openai:<base_url>#<model>",
                                elem_classes=[C.CLASS_FULL_ON_HOVER])
            default = services.default_adapter()  # a fine-tune made the default, else the shipped agent
            adapter = gr.Dropdown([C.NO_ADAPTER] + services.adapters(), value=default or C.NO_ADAPTER,
                                  allow_custom_value=True, label="Adapter (LoRA)",
                                  elem_classes=[C.CLASS_FULL_ON_HOVER])
            mode = gr.Radio(list(C.MODES), value=d["mode"], label="Rehearsal mode")
            with gr.Row():
                branches = gr.Number(d["branches"], label="K (branches)", info="1-16")
                temperature = gr.Slider(0.0, 2.0, value=d["temperature"], step=0.05, label="Temperature")
            proposal = gr.Radio(list(C.PROPOSALS), value=d["proposal"], label="Candidates",
                                info="sample: K-1 alternatives sampled at the temperature; tools: a call to "
                                     "each of the K-1 other tools the model ranks first")
            relevance = gr.Number(d["relevance"], label="Tool relevance",
                                  info="0-4: weight of log P(request | tool) when ranking tools; 0: the greedy "
                                       "action picks the tool")
            # What a first run never needs to touch waits in Advanced: a shorter left column.
            with gr.Accordion("Advanced", open=False):
                seed = gr.Number(d["seed"], label="Seed", info="0-2147483647")
                selector = gr.Dropdown(list(C.SELECTORS), value=d["selector"], label="Selector")
                keep_primary = gr.Checkbox(d["keep_primary"], label="Keep the greedy call unless its rehearsal "
                                           "predicts an error", info="off: the selector's top score commits")
                memory = gr.Radio(list(C.MEMORY_MODES), value=d["memory"], label="Rehearsal memory",
                                  info="real transitions each rehearsal sees: online (everything observed), seed "
                                       "(training split only), off")
                memory_k = gr.Number(d["memory_k"], label="Transitions per rehearsal", info="0-8")
                shadow = gr.Checkbox(d["shadow"], label="Shadow execution (run the alternatives on forks)")
                context = gr.Radio(list(C.REHEARSAL_CONTEXTS), value=d["rehearsal_context"], label="Rehearsal context")
                tool_choice = gr.Radio(list(C.TOOL_CHOICES), value=d["tool_choice"] if default is None else "auto",
                                       label="Tool choice", info="required: every step calls a tool; first: the first "
                                       "step after each user message does; auto: any step may answer in plain text")
                constrain = gr.Checkbox(d["constrain"], label="Schema-constrained decoding",
                                        info="calls match a tool's schema; rehearsals its response schema")
                max_action_tokens = gr.Number(d["max_action_tokens"], label="Max action tokens")
                max_rehearsal_tokens = gr.Number(d["max_rehearsal_tokens"], label="Max rehearsal tokens")
        with gr.Column(scale=4):
            with gr.Row():
                step_btn = gr.Button(C.STEP, variant="primary")
                turn_btn = gr.Button(C.RUN_TURN)
                all_btn = gr.Button(C.RUN_ALL)
                # Neutral while idle (red read as "something is wrong"); red only while a run is active.
                stop_btn = gr.Button(C.STOP, variant="secondary", elem_id=C.ID_RUN_STOP)
                reset_btn = gr.Button(C.RESET)
            message = gr.HTML("", elem_id=C.ID_RUN_MESSAGE, css_template=VIEW_CSS)
            status = gr.Markdown(render.episode_status(None, "Press Step to start."), elem_id=C.ID_RUN_STATUS)
            ahead = gr.Markdown("", elem_id=C.ID_RUN_AHEAD)
            ahead_timer = gr.Timer(C.AHEAD_POLL_S, active=services.compute_ahead)
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=320):
                    chat = gr.Chatbot(cb.preview_chat({"source": C.SOURCE_TASK, "task": C.DEFAULT_TASK}),
                                      label="Conversation", height=560, buttons=["copy_all"])
                    with gr.Row():
                        user_text = gr.Textbox(label="Speak as the user", lines=1, scale=4,
                                               placeholder="The next user message (instead of a scripted turn, "
                                                           "or after the last one)")
                        say_btn = gr.Button(C.SAY_AS_USER, scale=1)
                with gr.Column(scale=3, min_width=420):
                    timeline = gr.Radio([], label="Timeline: click a step to reopen it")
                    cards = gr.HTML(render.branch_cards(None), elem_id=C.ID_CARDS, css_template=VIEW_CSS,
                                    label="Branches of the step")
            state_view = gr.HTML(render.state_view(None), css_template=VIEW_CSS, label="Environment state")

    form = {"source": source, "task": task, "instruction": instruction, "instruction_env": instruction_env,
            "model": model, "adapter": adapter, "mode": mode, "branches": branches, "selector": selector,
            "temperature": temperature, "seed": seed, "shadow": shadow, "rehearsal_context": context,
            "tool_choice": tool_choice, "proposal": proposal, "relevance": relevance, "constrain": constrain, "max_action_tokens": max_action_tokens,
            "memory": memory, "memory_k": memory_k, "keep_primary": keep_primary,
            "max_rehearsal_tokens": max_rehearsal_tokens}
    outputs = [message, status, chat, timeline, cards, state_view]
    # One progress indicator, over the branch cards (where the step appears): on every output, a first Step's
    # "Loading model" line was printed six times over the tab.
    model_events = {"concurrency_id": "model", "concurrency_limit": C.MODEL_CONCURRENCY}
    # While a step runs, Step, Run turn and Run to end are disabled (a second press waits for the first to end,
    # it never queues a hidden extra step) and Stop is highlighted; both are restored however the step ends.
    run_buttons = [step_btn, turn_btn, all_btn]
    running = lambda: [gr.Button(variant="stop")] + [gr.Button(interactive=False)] * 3  # noqa: E731
    idle = lambda: [gr.Button(variant="secondary")] + [gr.Button(interactive=True)] * 3  # noqa: E731
    for button, run, name in ((step_btn, cb.step, "step"), (turn_btn, cb.run_turn, "run_turn"),
                              (all_btn, cb.run_all, "run_to_end")):
        button.click(running, None, [stop_btn] + run_buttons, queue=False, api_visibility="private",
                     show_progress="hidden") \
            .then(run, [session], outputs, inputs_kwargs=form, api_name=name, show_progress_on=cards,
                  **model_events) \
            .then(idle, None, [stop_btn] + run_buttons, queue=False, api_visibility="private", show_progress="hidden")
    # Stop must answer while a step holds a model slot: it gets its own, unlimited.
    stop_btn.click(cb.stop, [session], [message, status], api_name="stop", concurrency_limit=None,
                   concurrency_id="control")
    reset_btn.click(cb.reset, [session], outputs, inputs_kwargs=form, api_name="reset", show_progress_on=cards)
    # The person speaks as the user (it may start the episode, so it may load the model).
    say = {"inputs": [session, user_text], "outputs": outputs + [user_text], "inputs_kwargs": form,
           "show_progress_on": cards, **model_events}
    say_btn.click(cb.say, api_name="say_as_user", **say)
    user_text.submit(cb.say, api_visibility="private", **say)
    timeline.input(cb.show_step, [session, timeline], [cards, state_view], api_name="show_step")
    # Outside the queue: a lookup, it must not wait behind steps.
    ahead_timer.tick(cb.ahead_line, [session], ahead, queue=False, show_progress="hidden", api_visibility="private")

    # A served model runs its server's weights: picking one clears the LoRA adapter (it would refuse the step).
    model.input(lambda m, a: forms.adapter_for_model(m, a, C.NO_ADAPTER), [model, adapter], adapter, queue=False,
                api_visibility="private", show_progress="hidden")
    source.change(cb.toggle_source, source, [task_group, instruction_group], api_visibility="private")
    narrowing = [env_filter, category_filter, task_search, task]
    env_filter.input(cb.filter_tasks, narrowing, task, api_name="filter_tasks")
    for trigger in (category_filter.input, task_search.submit):
        trigger(cb.filter_tasks, narrowing, task, api_visibility="private")
    # As the person types or deletes, the last value's list wins (a lookup in memory: outside the queue). `change`:
    # Gradio's `input` missed deletions (Backspace) and pasted text.
    task_search.change(cb.filter_tasks, narrowing, task, api_visibility="private", trigger_mode="always_last",
                      queue=False, show_progress="hidden")
    for trigger in (task.change, source.change, instruction.blur):
        trigger(cb.preview, [session], [message, chat], inputs_kwargs=form, api_visibility="private")
    return {"session": session, "chat": chat, "adapter": adapter, "form": form, "outputs": outputs,
            "preview": cb.preview, "message": message, "adapter_choices": cb.adapter_choices}
