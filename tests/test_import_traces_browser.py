"""The Traces tab's trace upload in a real browser (Chromium): a third-party span file imports, its episode
opens with its recorded calls, and hostile names and results from a trace file stay text."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from app.ui import build_demo, close_demo
from app.ui import constants as C
from browser import launch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "third_party"
SCREENSHOT = os.environ.get("ENVACE_SCREENSHOT_TRACES")  # where to keep the picture; else the test's tmp_path

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    db = tmp_path_factory.mktemp("traces-browser") / "t.db"
    demo = build_demo(db_path=str(db), policy_loader=lambda model, adapter: None)  # no step runs here
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    yield demo, url
    close_demo(demo)


def _upload(page, path: Path, fmt_label: str) -> None:
    from playwright.sync_api import expect

    page.get_by_label(fmt_label).check()
    box = page.locator(f"#{C.ID_TRACES_FOREIGN_UPLOAD}")
    if box.locator("input[type=file]").count() == 0:  # the last upload is still shown: clear it first
        box.get_by_label("Clear").first.click()
    box.locator("input[type=file]").set_input_files(str(path))
    # Gradio shows the name as stem and suffix side by side; on a loaded machine a space can come between them.
    shown = re.compile(re.escape(path.stem) + r"\s*" + re.escape(path.suffix))
    expect(page.locator(f"#{C.ID_TRACES_FOREIGN_UPLOAD}")).to_contain_text(shown)
    page.get_by_role("button", name=C.IMPORT_TRACES, exact=True).click()


def test_upload_open_and_hostile_strings(served, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    demo, url = served
    evil = '<img src=x onerror="window.__pwned=1">'
    hostile = tmp_path / "hostile.jsonl"
    hostile.write_text(json.dumps({"messages": [
        {"role": "user", "content": f"<script>window.__pwned=2</script>{evil}"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": evil, "arguments": json.dumps({"q": evil})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": f"<b>bold</b>{evil}"}]}) + "\n")
    with sync_playwright() as p:
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.set_default_timeout(60_000)
        page.goto(url)
        page.get_by_role("tab", name="Traces").click()
        page.get_by_text("Import your own agent's traces").click()
        _upload(page, FIXTURES / "smolagents_openinference.jsonl", "OpenTelemetry OTLP/JSON (GenAI or OpenInference spans)")
        message = page.locator(f"#{C.ID_TRACES_FOREIGN_MESSAGE}")
        expect(message).to_contain_text("Imported 2 trace(s) as episodes", timeout=120_000)
        table = page.locator(f"#{C.ID_TRACES_TABLE}")
        first = demo.services.store.list_episodes()[0]["id"]
        expect(table).to_contain_text(first, timeout=60_000)
        table.get_by_text(first).filter(visible=True).first.click()  # a row opens its episode
        cards = page.locator(f"#{C.ID_TRACES_CARDS}")
        expect(cards).to_contain_text("get_weather", timeout=60_000)
        expect(page.locator(f"#{C.ID_TRACES_STATUS}")).to_contain_text("Imported")
        page.screenshot(path=SCREENSHOT or str(tmp_path / "traces.png"), full_page=True)

        _upload(page, hostile, "OpenAI chat JSONL (messages + tools)")
        expect(message).to_contain_text("Imported 1 trace(s) as episodes", timeout=120_000)
        row = demo.services.store.list_episodes()[0]
        expect(table).to_contain_text(row["id"], timeout=60_000)
        table.get_by_text(row["id"]).filter(visible=True).first.click()
        expect(cards).to_contain_text("onerror", timeout=60_000)  # shown as text
        assert page.evaluate("window.__pwned === undefined")
        assert cards.locator("img").count() == 0 and cards.locator("b").filter(has_text="bold").count() == 0
        browser.close()
