"""A first Step in a real browser (Debian's Chromium) at 1400x1000: while the model loads, one progress indicator
(over the branch cards) and one sentence saying the load happens once and about how long; and a step computed ahead
says in its header what its compute took, not the "0.0 s" Step itself took. The policy is scripted; its load waits
for the test, so the page is read while it loads."""
from __future__ import annotations

import threading
import time

import pytest

from app.envs import MOCK_TASK_ID
from app.service.session import LOAD_SLOW_S
from app.ui import build_demo, close_demo
from app.ui import constants as C
from browser import launch
from scripted import AheadPolicy

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TIMEOUT_MS = 120_000
WORK_S = 0.4
"""What the scripted model's act takes, ahead or at Step (a stand-in for the model's compute, not a wait)."""


VISIBLE_WITH = """text => [...document.querySelectorAll('body *')].filter(el =>
  [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.includes(text))
  && el.getClientRects().length > 0 && getComputedStyle(el).visibility !== 'hidden').length"""
"""How many visible elements hold `text` in their own text (not counting the ancestors that contain them)."""


def test_one_loading_indicator_and_a_step_computed_ahead_says_what_it_took(tmp_path) -> None:
    from playwright.sync_api import expect, sync_playwright

    release = threading.Event()

    def loader(model: str, adapter: str | None) -> AheadPolicy:
        release.wait(TIMEOUT_MS / 1000)  # the load lasts until the test has read the page
        return AheadPolicy(lambda: time.sleep(WORK_S), [["Stored it."], ["Done: the colour is blue."]])

    demo = build_demo(db_path=str(tmp_path / "first.db"), policy_loader=loader)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(url)
            task = page.get_by_label("Task", exact=True)
            task.click()
            task.fill(MOCK_TASK_ID)
            task.press("Enter")
            page.get_by_label("Tool relevance").fill("0")
            page.get_by_role("button", name=C.STEP, exact=True).click()

            # While the model loads: the progress line once, over the branch cards, and one sentence.
            cards = page.locator(f"#{C.ID_CARDS}")
            expect(cards).to_contain_text("Loading model embedded (once)", timeout=TIMEOUT_MS)
            sentence = f"once, on the first Step only (up to about {LOAD_SLOW_S // 60} minutes on a busy 2-core CPU)"
            expect(page.locator(f"#{C.ID_RUN_MESSAGE}")).to_contain_text(sentence, timeout=TIMEOUT_MS)
            page.screenshot(path=str(tmp_path / "loading.png"))
            assert page.evaluate(VISIBLE_WITH, "Loading model embedded (once)") == 1
            assert page.evaluate(VISIBLE_WITH, sentence) == 1
            release.set()

            status = page.locator(f"#{C.ID_RUN_STATUS}")
            expect(status).to_contain_text("1 step(s)", timeout=TIMEOUT_MS)
            assert page.evaluate(VISIBLE_WITH, "Loading model") == 0
            # Step 1 is computed while the person reads step 0; its header then says what that took.
            ahead = page.locator(f"#{C.ID_RUN_AHEAD}")
            expect(ahead).to_contain_text("Step 1 is computed ahead", timeout=TIMEOUT_MS)
            page.get_by_role("button", name=C.STEP, exact=True).click()
            expect(status).to_contain_text("2 step(s)", timeout=TIMEOUT_MS)
            head = cards.locator(".ea-step-head")
            expect(head).to_contain_text("Step 1", timeout=TIMEOUT_MS)
            expect(head).to_contain_text("computed ahead while the step before was read")
            total = float(head.inner_text().split(" · ")[-1].split(" s")[0])
            assert total >= WORK_S, head.inner_text()  # what the compute took ahead, not the 0.0 s at Step
            page.screenshot(path=str(tmp_path / "ahead.png"))
            browser.close()
    finally:
        release.set()
        close_demo(demo)
