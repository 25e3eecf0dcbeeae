"""The Gradio inspector: Run, Traces, Annotate, Dashboard and Fine-tune tabs.

`build_demo()` holds only layout and wiring; each tab has a layout module and a
callbacks module, and the work happens in `app.service` and `app.ui.render`.
"""
from __future__ import annotations

import asyncio
import sys
from typing import Any, Callable

import gradio as gr

from app.config import default_db_path
from app.service import Services
from app.ui import constants as C
from app.ui.annotate_callbacks import AnnotateCallbacks
from app.ui.annotate_tab import build_annotate_tab
from app.ui.assets import HOVER_JS, KEYBOARD_JS
from app.ui.dashboard_tab import build_dashboard_tab
from app.ui.finetune_tab import build_finetune_tab
from app.ui.run_tab import build_run_tab
from app.ui.traces_tab import build_traces_tab
from app.ui.world_model_api import only_world_model_public, register_world_model

__all__ = ["build_demo", "close_demo"]

INTRO = f"""## {C.TITLE}
Step a tool-using agent that **rehearses** its calls: each step proposes K candidate calls, the model
predicts each call's response, a selector commits one to the real tools, and the alternatives run on
forks (writes included) to show their real response. Compare predicted and actual responses, annotate divergences, track fidelity on the dashboard, and
fine-tune the agent on your corrections."""


SWITCH_INTERVAL_S = 0.0002
"""The server's GIL switch interval (`sys.setswitchinterval`; Python's default is 5 ms). A step decodes in a
worker thread that gives the GIL up and takes it back at every tensor op (about 500 a token); while another
thread runs pure Python (a visitor's page render, an upload being parsed), each take waits up to the interval.
bench/bench_gil.py measured batch-1 decode beside a busy thread on the 2-core CPU (29 tok/s alone): 0.09-7.4 tok/s
at 5 ms (median 0.27; it depends on which core each thread gets), 11-13 at 0.2 ms, where the busy thread keeps 70%
of its own speed."""


TRANSLATIONS = {"en": {"common.complete": "Complete"}}
"""Keys Gradio's frontend asks for and none of its locales defines (Gradio 6.31): when an event ends, its status
announcer (a live region for screen readers) says `i18n("common.complete")`, and without the key it said, and
page text dumps showed, the raw "common.complete". Other locales fall back to English for it."""


class InspectorBlocks(gr.Blocks):
    """The app's Blocks: whoever launches it (the CLI, the Space, a test) serves `TRANSLATIONS` too."""

    def launch(self, *args: Any, i18n: gr.I18n | None = None, **kwargs: Any) -> Any:
        if i18n is None:
            i18n = gr.I18n(**TRANSLATIONS)
        else:  # the caller's own, with ours where it has none
            i18n = gr.I18n(**{locale: {**TRANSLATIONS.get(locale, {}), **keys}
                              for locale, keys in {**TRANSLATIONS, **i18n.translations_dict}.items()})
        return super().launch(*args, i18n=i18n, **kwargs)


def build_demo(db_path: str | None = None, policy_loader: Callable[[str, str | None], Any] | None = None,
               mcp: bool = False) -> gr.Blocks:
    """The app. `policy_loader(model, adapter)` replaces model loading (tests inject a scripted policy).
    `mcp`: list only `rehearse` and `propose` as API endpoints (the MCP tools of `serve --mcp`)."""
    services = Services(db_path or default_db_path(), policy_loader)
    with InspectorBlocks(title=C.TITLE, fill_width=True) as demo:
        gr.Markdown(INTRO)
        with gr.Tabs() as tabs:
            with gr.Tab("Run", id="run"):
                run = build_run_tab(services)
            with gr.Tab("Traces", id="traces") as traces:
                build_traces_tab(services, traces, run, tabs)
            with gr.Tab("Annotate", id="annotate") as annotate:
                annotator = build_annotate_tab(services, annotate)
            with gr.Tab("Dashboard", id="dashboard") as dash:
                build_dashboard_tab(services, dash)
            with gr.Tab("Fine-tune", id="finetune") as finetune:
                build_finetune_tab(services, finetune, run["adapter"], run["adapter_choices"])
        demo.load(None, js=KEYBOARD_JS)
        demo.load(None, js=HOVER_JS)
        demo.load(AnnotateCallbacks.annotator_from_login, None, annotator, api_visibility="private")
        demo.load(run["adapter_choices"], None, run["adapter"], api_visibility="private")
        register_world_model(services)
    if mcp:
        only_world_model_public(demo)
    demo.queue(default_concurrency_limit=C.MODEL_CONCURRENCY, max_size=64)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # process-wide: this process serves the model's steps
    demo.services = services  # type: ignore[attr-defined]  # tests and app.py reach the store through it
    return demo


def close_demo(demo: gr.Blocks, timeout: float = 10.0) -> None:
    """Shut a launched demo down: Gradio's `close()` sets the app's asyncio stop event from the calling thread
    while the server's event loop may be adding or removing waiters on it (each open stream waits on it); under
    load that raised "RuntimeError: deque mutated during iteration" in `asyncio.Event.set` (seen in the test
    suite with two workers). The event is set on the server's own loop first, so `close()` finds it set and
    only stops the server. An event no coroutine has waited on yet has no loop (`_loop` is asyncio's own
    binding, Python 3.10+) and is safe to set from here."""
    event = getattr(getattr(demo, "app", None), "stop_event", None)
    loop = getattr(event, "_loop", None)
    if event is not None and loop is not None and loop.is_running() and not event.is_set():
        async def set_it() -> None:
            event.set()

        try:
            asyncio.run_coroutine_threadsafe(set_it(), loop).result(timeout)
        except (RuntimeError, TimeoutError):  # the loop closed meanwhile (nothing waits), or is stuck: close anyway
            pass
    demo.close()
