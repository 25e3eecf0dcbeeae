"""Hostile model output in a real browser: script tags, event-handler attributes, `javascript:`
links, a 1 MB string and unicode control characters in a call, a prediction and an answer render
as inert text in every tab (no script runs, no dialog fires, no element is injected), and the
store keeps them byte for byte. The policy is scripted, because the hostile text must be exact."""
from __future__ import annotations

import json

import pytest

from app.envs import MOCK_TASK_ID
from app.ui import build_demo, close_demo
from browser import launch
from app.ui import constants as C
from scripted import ScriptedPolicy

HOSTILE = ('<script>window.__pwned="script"</script><img src=x onerror="window.__pwned=\'img\';alert(1)">'
           "[click me](javascript:window.__pwned='link') <svg onload=\"window.__pwned='svg'\"></svg>"
           "<iframe src=\"javascript:alert(3)\"></iframe> \u202eevil\u202c \u200b\u0007 end")
BIG = "A" * 1_000_000
SHADOW_KEY = "<img src=x onerror=alert(2)>"
PREDICTED = {"ok": "<svg onload=alert(4)>", "note": HOSTILE}

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def call(key: str, value) -> str:
    return "<tool_call>" + json.dumps({"name": "set", "arguments": {"key": key, "value": value}}) + "</tool_call>"


def loader(model: str, adapter: str | None) -> ScriptedPolicy:
    return ScriptedPolicy([[call(HOSTILE, BIG), call(SHADOW_KEY, 1)], [HOSTILE]], predict=lambda prompt: PREDICTED)


def assert_inert(page, dialogs: list[str]) -> None:
    assert page.evaluate("window.__pwned") is None
    assert dialogs == []
    for selector in ('img[src="x"]', "svg[onload]", "img[onerror]", 'a[href^="javascript"]', "iframe[src^=javascript]"):
        assert page.locator(selector).count() == 0, selector
    assert page.locator("script", has_text="__pwned").count() == 0


def test_hostile_output_renders_as_text_everywhere_and_is_stored_exactly(tmp_path) -> None:
    from playwright.sync_api import expect, sync_playwright

    demo = build_demo(db_path=str(tmp_path / "hostile.db"), policy_loader=loader)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(60_000)
            expect.set_options(timeout=60_000)  # a step on a loaded machine can take more than expect's 5 s
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(url)
            task = page.get_by_label("Task", exact=True)
            task.click()
            task.fill(MOCK_TASK_ID)
            task.press("Enter")
            page.get_by_text("Advanced").click()
            page.get_by_label("Selector").click()
            page.get_by_role("option", name="logprob").click()
            page.get_by_label("Tool relevance").fill("0")  # the scripted candidates stay the test's own
            status = page.locator(f"#{C.ID_RUN_STATUS}")
            for n in (1, 2):
                page.get_by_role("button", name=C.STEP, exact=True).click()
                expect(status).to_contain_text(f"{n} step(s)")
            cards = page.locator(f"#{C.ID_CARDS}")
            page.get_by_role("radio", name="0 ·", exact=False).first.click()
            expect(cards).to_contain_text("<img src=x onerror=alert(2)>")  # the shadow branch's key, as text
            expect(cards).to_contain_text("<svg onload=alert(4)>")  # the prediction, as text
            expect(page.locator(".message-wrap")).to_contain_text('<script>window.__pwned="script"</script>')
            assert_inert(page, dialogs)

            episode_id = demo.services.store.list_episodes()[0]["id"]
            page.get_by_role("tab", name="Traces").click()
            table = page.locator(f"#{C.ID_TRACES_TABLE}")
            expect(table).to_contain_text(episode_id)
            table.get_by_text(episode_id).filter(visible=True).first.click()
            expect(page.locator(f"#{C.ID_TRACES_CARDS}")).to_contain_text("<svg onload=alert(4)>")
            assert_inert(page, dialogs)

            page.get_by_role("tab", name="Annotate").click()
            page.get_by_label("Diverged only").uncheck()
            page.get_by_role("button", name="Load queue").click()
            expect(page.get_by_text("Branch 1 of")).to_be_visible()
            assert_inert(page, dialogs)
            # An annotation whose name, note and corrected action are hostile: shown back as text.
            page.get_by_label("Annotator").fill(SHADOW_KEY)
            page.get_by_label("Corrected action").fill(HOSTILE)
            page.get_by_label(C.ANN_PLAIN_ANSWER).check()  # plain text: an answer, marked as one
            page.get_by_label("Note").fill(HOSTILE)
            page.locator(f"#{C.ID_ANN_SAVE}").click()
            expect(page.locator(f"#{C.ID_ANN_MESSAGE}")).to_contain_text("Saved annotation")
            page.get_by_role("button", name=C.PREV).click()
            expect(page.get_by_text("Earlier annotations")).to_be_visible()
            assert_inert(page, dialogs)

            page.get_by_role("tab", name="Fine-tune").click()  # its preview lists the corrected branch
            expect(page.get_by_text(f"Rehearse row(s) (episodes: {episode_id})")).to_be_visible()
            expect(page.get_by_label("Branches to train on")).to_contain_text(episode_id)
            assert_inert(page, dialogs)

            page.get_by_role("tab", name="Dashboard").click()
            page.get_by_role("button", name="Refresh").click()
            expect(page.locator(".js-plotly-plot").filter(visible=True).first).to_be_visible()
            assert_inert(page, dialogs)
            browser.close()
    finally:
        close_demo(demo)

    ep = demo.services.store.get_episode(episode_id)
    first, second = ep.steps
    assert first.chosen_branch.call.arguments == {"key": HOSTILE, "value": BIG}  # 1 MB, byte for byte
    assert first.chosen_branch.predicted == PREDICTED
    assert {b.call.arguments["key"] for b in first.branches} == {HOSTILE, SHADOW_KEY}
    assert second.chosen_branch.action_text == HOSTILE
