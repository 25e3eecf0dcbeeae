"""What a new user reads in a real browser (Debian's Chromium) when an episode ends and when they discard one:
the Run tab says why the episode ended, Discard asks first and names what it would delete, the task search finds
tasks by their tools, and the status announcer never says a raw i18n key ("common.complete"). The policy is
scripted: the texts checked here depend on how the episode ends, not on what a model writes."""
from __future__ import annotations

import json

import pytest

from app.envs import MOCK_TASK_ID
from app.ui import build_demo, close_demo
from app.ui import constants as C
from browser import launch
from scripted import ScriptedPolicy

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TIMEOUT_MS = 120_000
"""Each wait is for a condition, with this deadline (a loaded 2-core machine serves the page slowly)."""
ANNOUNCED = """
window.__announced = [];
document.addEventListener('DOMContentLoaded', () => new MutationObserver(ms => {
  for (const m of ms) {
    const el = m.target.nodeType === 3 ? m.target.parentElement : m.target;
    const region = el && el.closest ? el.closest('[role=status]') : null;
    if (region && region.textContent.trim()) window.__announced.push(region.textContent.trim());
  }
}).observe(document.body, {subtree: true, childList: true, characterData: true}));
"""
"""Records every text Gradio's status announcer (its live regions) says while the page is open."""


def loader(model: str, adapter: str | None) -> ScriptedPolicy:
    # Episode 1 answers both user turns of the mock task; episode 2 calls a tool, then is stopped.
    list_keys = "<tool_call>" + json.dumps({"name": "list_keys", "arguments": {}}) + "</tool_call>"
    return ScriptedPolicy([["Stored it."], ["Done: the colour is blue."], [list_keys]])


def test_the_end_reason_the_discard_question_and_the_task_search_read_in_the_browser(tmp_path) -> None:
    from playwright.sync_api import expect, sync_playwright

    demo = build_demo(db_path=str(tmp_path / "ended.db"), policy_loader=loader)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    store = demo.services.store
    try:
        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.add_init_script(ANNOUNCED)
            page.goto(url)

            # Task search looks in tool names: typing "post_tweet" narrows the list to the TwitterAPI tasks.
            search = page.get_by_label("Search tasks")
            search.press_sequentially("post_tweet", delay=20)
            twitter = len(demo.services.catalog.ids_with_class("TwitterAPI"))
            expect(page.get_by_text(f"{twitter} task(s) match")).to_be_visible(timeout=TIMEOUT_MS)
            search.press("Control+a")
            search.press("Backspace")
            expect(page.get_by_text(f"{len(demo.services.catalog.tasks)} task(s) match")).to_be_visible(
                timeout=TIMEOUT_MS)

            task = page.get_by_label("Task", exact=True)
            task.click()
            task.fill(MOCK_TASK_ID)
            task.press("Enter")
            page.get_by_label("Tool relevance").fill("0")  # the scripted candidates stay the test's own
            status, message = page.locator(f"#{C.ID_RUN_STATUS}"), page.locator(f"#{C.ID_RUN_MESSAGE}")
            step = page.get_by_role("button", name=C.STEP, exact=True)
            for n in (1, 2):
                step.click()
                expect(status).to_contain_text(f"{n} step(s)", timeout=TIMEOUT_MS)
            expect(status).to_contain_text("Ended: all 2 user turns done: the agent answered the last one")
            step.click()  # on an episode that is over: the message says why it is over
            expect(message).to_contain_text("This episode is over (all 2 user turns done: the agent answered the "
                                            "last one): press Reset", timeout=TIMEOUT_MS)
            page.screenshot(path=str(tmp_path / "ended.png"))

            # A second episode, one step, then stopped: it may be discarded.
            page.get_by_role("button", name=C.RESET, exact=True).click()
            expect(message).to_contain_text("Reset", timeout=TIMEOUT_MS)
            step.click()
            expect(status).to_contain_text("1 step(s)", timeout=TIMEOUT_MS)
            page.locator(f"#{C.ID_RUN_STOP}").click()
            expect(message).to_contain_text("stopped and saved", timeout=TIMEOUT_MS)
            stopped = next(r["id"] for r in store.list_episodes() if r["status"] == "stopped")

            page.get_by_role("tab", name="Traces").click()
            table = page.locator(f"#{C.ID_TRACES_TABLE}")
            expect(table).to_contain_text(stopped, timeout=TIMEOUT_MS)
            table.get_by_text(stopped).filter(visible=True).first.click()
            expect(page.locator(f"#{C.ID_TRACES_STATUS}")).to_contain_text(
                "Ended: stopped after 1 step and 0 finished user turns", timeout=TIMEOUT_MS)
            confirm = page.locator(f"#{C.ID_DISCARD_CONFIRM}")
            expect(confirm).to_be_hidden()
            page.get_by_role("button", name=C.DISCARD, exact=True).click()
            expect(confirm).to_be_visible(timeout=TIMEOUT_MS)
            expect(confirm).to_contain_text(f"Delete episode {stopped} (task {MOCK_TASK_ID}, stopped): its 1 step "
                                            "and 0 annotations go with it")
            page.screenshot(path=str(tmp_path / "discard-question.png"))
            assert store.get_episode(stopped).status == "stopped"  # asking deleted nothing
            page.get_by_role("button", name=C.DISCARD_CANCEL).click()
            expect(confirm).to_be_hidden(timeout=TIMEOUT_MS)
            expect(page.locator(f"#{C.ID_TRACES_MESSAGE}")).to_contain_text("kept: nothing was deleted")
            assert store.get_episode(stopped).status == "stopped"
            page.get_by_role("button", name=C.DISCARD, exact=True).click()
            expect(confirm).to_be_visible(timeout=TIMEOUT_MS)
            page.get_by_role("button", name=C.DISCARD_CONFIRM).click()
            expect(page.locator(f"#{C.ID_TRACES_MESSAGE}")).to_contain_text(f"Episode {stopped} (stopped, 1 step(s), "
                                                                            "0 annotation(s)) discarded",
                                                                            timeout=TIMEOUT_MS)
            expect(confirm).to_be_hidden()
            expect(table).not_to_contain_text(stopped, timeout=TIMEOUT_MS)

            announced = page.evaluate("window.__announced")
            browser.close()
    finally:
        close_demo(demo)
    assert [r["id"] for r in store.list_episodes()] != [] and stopped not in [r["id"] for r in store.list_episodes()]
    # The announcer spoke (so the check below is not vacuous); whether it says "Complete" depends on how fast the
    # events finish (a loaded clean-clone run heard only "Loading"), so that word is not required.
    assert announced
    assert not [text for text in announced if "common." in text], announced
