"""The inspector in a real browser with the real embedded model (Debian's Chromium via Playwright).

Pick a task, press Step twice (the second step computed ahead while the page showed the first), see branch
cards with predicted and actual responses,
annotate one branch with a correction (an invalid one first), find the episode in the
Traces tab and the annotation in the database. Takes the Run tab's screenshot into the test's tmp_path, or
into $ENVACE_SCREENSHOT: `make screenshot` writes docs/screenshot-run.png, the one the README shows.
"""
from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest

import model_backend.policy as policy_module
from app.service import session as session_module
from app.ui import build_demo, close_demo
from browser import launch
from app.ui import constants as C

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = os.environ.get("ENVACE_SCREENSHOT")  # set by `make screenshot`; else the test's tmp_path
STEP_TIMEOUT_MS = 240_000
"""One real step takes 10-20 s on 2 idle cores; shared machines are several times slower."""
TASK = "bfcl:multi_turn_base_0"

pytestmark = [pytest.mark.browser, pytest.mark.slow]



@pytest.fixture(scope="module")
def served(tmp_path_factory):
    db = tmp_path_factory.mktemp("browser") / "browser.db"
    demo = build_demo(db_path=str(db))  # the real embedded model, loaded on the first Step
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)  # first free port
    yield demo, url
    close_demo(demo)


@pytest.fixture(scope="module")
def page(served):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.set_default_timeout(30_000)
        yield page
        browser.close()


def test_step_annotate_and_find_it(served, page, monkeypatch, tmp_path):
    from playwright.sync_api import expect

    demo, url = served
    page.goto(url)

    # Pick the task through the searchable dropdown.
    task = page.get_by_label("Task", exact=True)
    task.click()
    task.fill(f"{TASK} ·")
    page.get_by_role("option", name=f"{TASK} ·").first.click()
    expect(page.locator(".message-wrap")).to_contain_text("final_report.pdf")
    # The dropdown cuts the value to its width; hovering shows all of it.
    task.hover()
    full = task.input_value()
    assert full.startswith(f"{TASK} ·") and len(full) > 40
    expect(task).to_have_attribute("title", full)

    # Small, fast settings: 3 branches, the logprob selector (no judge pass), short generations.
    page.get_by_label("K (branches)").fill("3")
    page.get_by_text("Advanced").click()  # seed, selector, shadow and context live there
    page.get_by_label("Selector").click()
    page.get_by_role("option", name="logprob").click()
    page.get_by_label("Max action tokens").fill("48")
    page.get_by_label("Max rehearsal tokens").fill("48")

    status = page.locator(f"#{C.ID_RUN_STATUS}")
    ahead = page.locator(f"#{C.ID_RUN_AHEAD}")
    stop = page.locator(f"#{C.ID_RUN_STOP}")
    passes = []
    for n in (1, 2):
        expect(stop).not_to_have_class(re.compile(r"\bstop\b"))  # neutral while idle
        if n == 2:
            # While the page showed step 0, the server computed step 1 ahead, and the line under the buttons
            # says so (a timer asks); once it is done, Step only looks it up (no generate or score pass).
            expect(ahead).to_contain_text("Step 1 is computed ahead", timeout=STEP_TIMEOUT_MS)
            for name in ("generate", "score"):  # passes of the step itself (step 3 is then computed ahead)
                real = getattr(policy_module, name)

                def counted(*a, _real=real, _name=name, **k):
                    if threading.current_thread().name != session_module.AHEAD_THREAD:
                        passes.append(_name)
                    return _real(*a, **k)

                monkeypatch.setattr(policy_module, name, counted)
        page.get_by_role("button", name=C.STEP, exact=True).click()
        if n == 1:
            expect(stop).to_have_class(re.compile(r"\bstop\b"))  # red while the step runs
            expect(page.get_by_role("button", name=C.STEP, exact=True)).to_be_disabled()  # no second press meanwhile
        expect(status).to_contain_text(f", {n} step(s)", timeout=STEP_TIMEOUT_MS)
    assert passes == [], f"step 2 ran {passes} though it was computed ahead"
    expect(stop).not_to_have_class(re.compile(r"\bstop\b"))
    expect(page.get_by_role("button", name=C.STEP, exact=True)).to_be_enabled()
    cards = page.locator(f"#{C.ID_CARDS} .ea-card")
    expect(cards.first).to_be_visible()
    counts = [cards.count()]
    page.get_by_role("radio", name="0 ·", exact=False).first.click()  # reopen step 0 from the timeline
    expect(page.locator(f"#{C.ID_CARDS}")).to_contain_text("Step 0 ·")
    counts.append(cards.count())
    assert max(counts) >= 2, f"branch cards per step: {counts}"
    text = page.locator(f"#{C.ID_CARDS}").inner_text()
    assert "Predicted" in text and "Actual · committed" in text and "✓ committed" in text
    shot = Path(SCREENSHOT) if SCREENSHOT else tmp_path / "screenshot-run.png"
    page.screenshot(path=str(shot), full_page=False)
    assert shot.read_bytes().startswith(b"\x89PNG")

    # Annotate: the keyboard picks the label, an invalid correction is refused, a valid one saved.
    page.get_by_role("tab", name="Annotate").click()
    page.get_by_label("Diverged only").uncheck()
    page.get_by_role("button", name="Load queue").click()
    expect(page.get_by_text("Branch 1 of")).to_be_visible()
    page.get_by_label("Annotator").fill("browser-test")
    page.locator("body").click(position={"x": 5, "y": 5})
    page.keyboard.press("3")
    expect(page.locator(f"#{C.ID_ANN_LABEL} input[value='major']")).to_be_checked()
    editor = page.locator(f"#{C.ID_ANN_CODE} .cm-content")
    editor.click()
    page.keyboard.insert_text('{"current_directory_content": [')
    page.keyboard.press("Control+Enter")
    expect(page.locator(f"#{C.ID_ANN_MESSAGE}")).to_contain_text("not valid JSON")
    assert demo.services.store.annotations() == []
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text('{"current_directory_content": ["document", "archive"]}')
    page.keyboard.press("Control+Enter")
    expect(page.locator(f"#{C.ID_ANN_MESSAGE}")).to_contain_text("Saved annotation")

    rows = demo.services.store.annotations()
    assert len(rows) == 1 and rows[0]["label"] == "major" and rows[0]["annotator"] == "browser-test"
    assert json.loads(rows[0]["corrected_predicted"]) == {"current_directory_content": ["document", "archive"]}
    branch_row, _ = demo.services.store.get_branch(rows[0]["branch_id"])

    # Traces: the annotated branch's episode is listed, and opens read-only.
    page.get_by_role("tab", name="Traces").click()
    table = page.locator(f"#{C.ID_TRACES_TABLE}")
    expect(table).to_contain_text(branch_row["episode_id"])
    table.get_by_text(branch_row["episode_id"]).filter(visible=True).first.click()  # a row opens its episode
    expect(page.locator(f"#{C.ID_TRACES_STATUS}")).to_contain_text(branch_row["episode_id"])
    expect(page.locator(f"#{C.ID_TRACES_CARDS} .ea-card").first).to_be_visible()
