"""Callbacks of the Run tab: turn form values into a RunRequest, drive the session, render.

Thin by design: the work happens in `app.service.RunSession` (engine + saving)
and `app.ui.render` (views); here are only the translations between the two and Gradio.
"""
from __future__ import annotations

import html
from typing import Any, Iterator

import gradio as gr

from app.service import (InputError, RunRequest, RunSession, Services, end_reason_text, load_note,
                         parse_settings, task_turns)
from app.ui import constants as C
from app.ui import render

RunView = tuple[str, str, list, Any, str, str]
"""message, status, conversation, timeline, branch cards, state view."""


def message_html(text: str = "", kind: str = "info") -> str:
    if not text:
        return ""
    return f'<div class="ea-msg ea-msg-{kind}">{html.escape(text)}</div>'


def request_from_form(form: dict[str, Any]) -> RunRequest:
    """Validate the Run tab's values (InputError names what to fix)."""
    settings = parse_settings(
        mode=form["mode"], branches=form["branches"], selector=form["selector"],
        temperature=form["temperature"], seed=form["seed"], shadow=form["shadow"],
        rehearsal_context=form["rehearsal_context"], tool_choice=form["tool_choice"],
        proposal=form["proposal"], relevance=form["relevance"], constrain=bool(form["constrain"]),
        memory=form.get("memory", C.UI_DEFAULTS["memory"]), memory_k=form.get("memory_k", C.UI_DEFAULTS["memory_k"]),
        keep_primary=bool(form.get("keep_primary", C.UI_DEFAULTS["keep_primary"])),
        max_action_tokens=form["max_action_tokens"], max_rehearsal_tokens=form["max_rehearsal_tokens"])
    model = (form["model"] or "").strip()
    if not model:
        raise InputError("Model is empty: use `embedded`, `hf:<id or path>` or `openai:<url>#<model>`.")
    adapter = form["adapter"] if form["adapter"] not in (None, "", C.NO_ADAPTER) else None
    if form["source"] == C.SOURCE_INSTRUCTION:
        return RunRequest(task_id=None, instruction=form["instruction"] or "", env_class=form["instruction_env"] or "",
                          model=model, adapter=adapter, settings=settings)
    task_id = (form["task"] or "").strip()
    if not task_id:
        raise InputError("No task selected: pick a task from the list (type to search), or switch to "
                         f"'{C.SOURCE_INSTRUCTION}'.")
    return RunRequest(task_id=task_id, model=model, adapter=adapter, settings=settings)


def form_from_request(request: RunRequest) -> dict[str, Any]:
    """The Run tab's values that `request_from_form` reads back as `request` (continuing a stored episode)."""
    s = request.settings
    return {"source": C.SOURCE_TASK, "task": request.task_id, "model": request.model,
            "adapter": request.adapter or C.NO_ADAPTER, "mode": s.mode, "branches": s.branches,
            "selector": s.selector, "temperature": s.temperature, "seed": s.seed, "shadow": s.shadow,
            "rehearsal_context": s.rehearsal_context, "tool_choice": s.tool_choice,
            "proposal": s.proposal, "relevance": s.relevance, "constrain": s.constrain, "max_action_tokens": s.max_action_tokens,
            "max_rehearsal_tokens": s.max_rehearsal_tokens, "memory": s.memory, "memory_k": s.memory_k,
            "keep_primary": s.keep_primary}


class RunCallbacks:
    def __init__(self, services: Services) -> None:
        self.services = services

    # ------------------------------------------------------------ views

    def ahead_line(self, session: RunSession) -> str:
        return render.ahead_line(session.ahead_status())

    def view(self, session: RunSession, message: str = "") -> RunView:
        notices = session.take_notices()
        if notices and not message:
            message = message_html(" ".join(notices))
        ep = session.episode
        if ep is None:
            return (message, render.episode_status(None, "Press Step to start."), gr.skip(),
                    gr.Radio(choices=[], value=None), render.branch_cards(None), render.state_view(None))
        shown = self._shown_step(session)
        open_turn = None if session.runner.done else session.runner.turn
        chat = render.chat_messages(session.task.turns, ep.steps, open_turn=open_turn)
        timeline = gr.Radio(choices=render.timeline_choices(ep.steps), value=shown.index if shown else None)
        return (message, render.episode_status(ep, session.model_note()), chat, timeline, render.branch_cards(shown),
                render.state_view(shown))

    @staticmethod
    def _shown_step(session: RunSession):
        steps = session.episode.steps if session.episode else []
        if not steps:
            return None
        index = session.view_step if session.view_step is not None else len(steps) - 1
        return steps[min(index, len(steps) - 1)]

    # ------------------------------------------------------------ events

    def step(self, session: RunSession, progress=gr.Progress(), **form: Any) -> Iterator[RunView]:
        yield from self._drive(session, form, "step", progress)

    def run_turn(self, session: RunSession, progress=gr.Progress(), **form: Any) -> Iterator[RunView]:
        yield from self._drive(session, form, "turn", progress)

    def run_all(self, session: RunSession, progress=gr.Progress(), **form: Any) -> Iterator[RunView]:
        yield from self._drive(session, form, "all", progress)

    def _drive(self, session: RunSession, form: dict[str, Any], scope: str, progress: Any) -> Iterator[RunView]:
        try:
            request = request_from_form(form)
            with session.busy():
                done_before = len(session.episode.steps) if session.episode else 0

                def report(fraction: float, text: str) -> None:
                    n = len(session.episode.steps) if session.episode else 0
                    progress(fraction, desc=f"Step {n}: {text}")

                loaded = self.services.is_loaded(request.model, request.adapter)
                yield (message_html(load_note(request.model, loaded)), *(gr.skip(),) * 5)
                if scope == "step":
                    step = session.step(self.services, request, report)
                    yield self.view(session, message_html("" if step else self.over(session)))
                else:
                    for _ in session.iterate(self.services, request, scope, report):
                        yield self.view(session)
                    if session.episode and len(session.episode.steps) == done_before and session.runner.done:
                        yield self.view(session, message_html(self.over(session)))
                    else:
                        yield self.view(session)
        except InputError as exc:
            gr.Warning(str(exc))
            yield self.view(session, message_html(str(exc), "error"))
            return
        session.compute_ahead(self.services)  # runs once the last view is on its way to the page

    @staticmethod
    def over(session: RunSession) -> str:
        """Step pressed on an episode that has ended: why it ended, and what to do."""
        why = end_reason_text(session.episode) if session.episode else ""
        return (f"This episode is over{f' ({why})' if why else ''}: press Reset (or change the task) "
                "to start a new one.")

    def say(self, session: RunSession, text: str, **form: Any) -> tuple:
        """The person types the next user message; Step then lets the agent answer it."""
        try:
            request = request_from_form(form)
            with session.busy():
                turn = session.add_user_message(self.services, request, text)
        except InputError as exc:
            gr.Warning(str(exc))
            return (*self.view(session, message_html(str(exc), "error")), gr.skip())
        note = f"User turn {turn + 1} added: press Step or Run turn to let the agent answer."
        view = self.view(session, message_html(note))
        session.compute_ahead(self.services)
        return (*view, "")

    def stop(self, session: RunSession) -> tuple[str, str]:
        text = session.request_stop(self.services)
        return message_html(text), render.episode_status(session.episode)

    def reset(self, session: RunSession, **form: Any) -> RunView:
        if session.is_busy:
            text = "A step is running: press Stop first, then Reset when it has finished."
            gr.Warning(text)
            return self.view(session, message_html(text, "error"))
        session.reset(self.services)
        message, status, _, timeline, cards, state = self.view(session)
        self._prepare(session, form)
        return (message_html("Reset: the next Step starts a new episode."), status, self.preview_chat(form),
                timeline, cards, state)

    def show_step(self, session: RunSession, index: int | None) -> tuple[str, str]:
        """Reopen an earlier step from the timeline."""
        steps = session.episode.steps if session.episode else []
        if index is None or not 0 <= int(index) < len(steps):
            return render.branch_cards(None), render.state_view(None)
        session.view_step = int(index)
        step = steps[int(index)]
        return render.branch_cards(step), render.state_view(step)

    # ------------------------------------------------------------ task picker

    def preview_chat(self, form: dict[str, Any]) -> list[dict[str, Any]]:
        """The selected task's first user turn, so a visitor sees what Step will work on."""
        if form.get("source") == C.SOURCE_INSTRUCTION:
            text = (form.get("instruction") or "").strip()
            return [{"role": "user", "content": text}] if text else []
        info = self.services.catalog.tasks.get(form.get("task") or "")
        if info is None:
            return []
        return render.chat_messages(task_turns(info.id), [], open_turn=0)

    def preview(self, session: RunSession, **form: Any) -> tuple[str, Any]:
        if session.episode is not None and session.episode.steps:
            try:
                same = request_from_form(form).key == session.request.key
            except InputError:
                same = True
            note = "" if same else "The next Step starts a new episode with this task and these settings."
            return message_html(note), gr.skip()
        self._prepare(session, form)
        return "", self.preview_chat(form)

    def _prepare(self, session: RunSession, form: dict[str, Any]) -> None:
        """The first step of the picked task, computed while the person reads it (`RunSession.prepare`)."""
        try:
            request = request_from_form(form)
        except InputError:
            return  # Step will say what is wrong with the form
        session.prepare(self.services, request)

    def task_choices(self, env_class: str, category: str, query: str = "") -> list[tuple[str, str]]:
        infos = self.services.catalog.filter(None if env_class == C.ALL else env_class,
                                             None if category == C.ALL else category, query or "")
        return [(f"{t.id} · {render.short(t.first_message, 70)}", t.id) for t in infos]

    def filter_tasks(self, env_class: str, category: str, query: str, current: str | None) -> Any:
        """The Task list under the filters and the search words (`TaskCatalog.filter`)."""
        choices = self.task_choices(env_class, category, query)
        ids = [value for _, value in choices]
        value = current if current in ids else (ids[0] if ids else None)
        found = f"{len(ids)} task(s) match" if ids else "no task matches: try fewer or other words"
        return gr.Dropdown(choices=choices, value=value, info=f"{found}; {C.TASK_LIST_INFO}")

    @staticmethod
    def toggle_source(source: str) -> tuple[Any, Any]:
        instruction = source == C.SOURCE_INSTRUCTION
        return gr.Group(visible=not instruction), gr.Group(visible=instruction)

    def adapter_choices(self) -> Any:
        return gr.Dropdown(choices=[C.NO_ADAPTER] + self.services.adapters())
