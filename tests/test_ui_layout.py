"""The Traces and Annotate tabs in a real browser (Debian's Chromium) at 1400x1000, read by layout: the episodes
table gives each column at least its header's width and cuts no cell, its success column says the judged result or
why there is none, a replayed step's fork-diff table stays inside its card; the Annotate tab asks for the annotator
first and remembers the name in this browser, its keyboard sheet opens where it is seen, and a typed instruction's
branch says what annotating it is for. The episodes are real BFCL runs of a scripted policy (the layout depends on
their shape, not on what a model writes) and the expert's replays."""
from __future__ import annotations

import json

import pytest

from app import envs
from app.engine import EpisodeRunner
from app.records import RunSettings
from app.service import RunRequest, RunSession, Services
from app.service.annotations import INSTRUCTION_BRANCH_USE
from app.store import Recorder
from app.training.rows import expert_episode
from app.ui import build_demo, close_demo
from app.ui import constants as C
from app.ui import render
from browser import launch
from scripted import ScriptedPolicy

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TIMEOUT_MS = 120_000
TASK = "bfcl:multi_turn_base_0"


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def seed(db: str) -> tuple[str, str]:
    """A stopped parallel episode whose alternatives write on forks (long paths in their fork diffs), two
    judged expert replays and a typed instruction's episode; returns the first's and the last's ids."""
    services = Services(db, policy_loader=lambda model, adapter: ScriptedPolicy([[call("pwd")], ["Done."]]))
    store = services.store
    policy = ScriptedPolicy([[call("ls"), call("mkdir", dir_name="temp_archive_folder_with_a_long_name"),
                              call("touch", file_name="notes_for_the_quarterly_review.txt")], ["Done."]])
    runner = EpisodeRunner(envs.load_task(TASK), policy,
                           RunSettings(mode="parallel", branches=3, selector="logprob", shadow=True),
                           model="embedded", adapter="fixtures/adapters/envace-smollm2-135m")
    recorder = Recorder(store)
    recorder.start(runner.episode)
    runner.on_step = recorder
    runner.step()
    runner.stop()
    recorder.flush(runner.episode)  # stopped by the person after one step
    for task_id in (TASK, "bfcl:multi_turn_base_1"):
        episode = expert_episode(envs.load_task(task_id))
        expert = Recorder(store)
        expert.start(episode)
        for step in episode.steps:
            expert(episode, step)
    session = RunSession()
    request = RunRequest(task_id=None, instruction="Where am I? Print the working directory.",
                         env_class="GorillaFileSystem", model="embedded",
                         settings=RunSettings(mode="none", branches=1))
    session.step(services, request)
    session.close(services)
    return runner.episode.id, session.episode.id


NARROWER_THAN_HEADER = """sel => [...document.querySelectorAll(sel + ' th span.header')].filter(span => {
  const text = span.innerText.trim();
  const ctx = document.createElement('canvas').getContext('2d');
  ctx.font = getComputedStyle(span).font;
  const widest = Math.max(...text.split(/\\s+/).map(w => ctx.measureText(w).width));
  return span.getBoundingClientRect().width < widest - 1;
}).map(span => span.innerText.trim())"""
"""The header cells whose widest word does not fit their column (a squeezed column wraps it a letter a line)."""
CUT_CELLS = """sel => [...document.querySelectorAll(sel + ' .body-cell')].filter(cell =>
  cell.scrollWidth > cell.clientWidth + 1 || [...cell.querySelectorAll('span')].some(span =>
    span.getBoundingClientRect().right > cell.getBoundingClientRect().right + 1)).map(cell => cell.innerText.trim())"""
"""The table's visible cells (Gradio 6 draws them as div.body-cell) whose text runs past their edge."""
OVERFLOWING = """() => [...document.querySelectorAll('.ea-fork-diff table')].filter(t => {
  const card = t.closest('.ea-card').getBoundingClientRect(), box = t.getBoundingClientRect();
  return box.right > card.right + 0.5 || box.left < card.left - 0.5;
}).length"""


def test_traces_and_annotate_fit_and_explain_at_1400(tmp_path) -> None:
    from playwright.sync_api import expect, sync_playwright

    db = str(tmp_path / "layout.db")
    interrupted, instruction = seed(db)
    demo = build_demo(db_path=db, policy_loader=lambda model, adapter: ScriptedPolicy([]))
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        with sync_playwright() as p:
            browser = launch(p)
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            page.set_default_timeout(60_000)
            page.goto(url)

            # Traces: every column at least its header's width, no cell cut, the success column filled.
            page.get_by_role("tab", name="Traces").click()
            table = page.locator(f"#{C.ID_TRACES_TABLE}")
            expect(table).to_contain_text(interrupted, timeout=TIMEOUT_MS)
            expect(table).to_contain_text("not judged: stopped")
            expect(table).to_contain_text("none: a typed instruction")
            expect(table.locator(".body-cell", has_text="yes").first).to_be_visible()
            assert table.locator("th span.header").count() == len(render.EPISODE_COLUMNS)
            page.screenshot(path=str(tmp_path / "traces-table.png"))
            assert page.evaluate(NARROWER_THAN_HEADER, f"#{C.ID_TRACES_TABLE}") == []
            assert page.evaluate(CUT_CELLS, f"#{C.ID_TRACES_TABLE}") == []
            frame = table.bounding_box()
            assert frame["x"] + frame["width"] <= 1400

            # A replayed step: the fork-diff tables stay inside their cards, the cards inside their column.
            table.get_by_text(interrupted).click()
            cards = page.locator(f"#{C.ID_TRACES_CARDS}")
            expect(cards.locator(".ea-fork-diff table").first).to_be_visible(timeout=TIMEOUT_MS)
            cards.locator(".ea-fork-diff table").first.scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / "traces-replay.png"))
            assert page.evaluate(OVERFLOWING) == 0
            column = cards.bounding_box()
            for box in (c.bounding_box() for c in cards.locator(".ea-card").all()):
                assert box["x"] >= column["x"] - 0.5 and box["x"] + box["width"] <= column["x"] + column["width"] + 0.5
            assert column["width"] >= 560  # the wider column: the chat no longer takes two thirds

            # Annotate: the annotator first (above the queue's filters), its need said before any save.
            page.get_by_role("tab", name="Annotate").click()
            annotator = page.get_by_label("Annotator")
            expect(annotator).to_be_visible()
            expect(page.locator(f"#{C.ID_ANN_ANNOTATOR}")).to_contain_text("needed before Save")
            load = page.get_by_role("button", name="Load queue")
            assert annotator.bounding_box()["y"] < load.bounding_box()["y"]
            assert annotator.bounding_box()["y"] + annotator.bounding_box()["height"] <= 1000
            annotator.fill("layout-test")
            annotator.blur()

            # The keyboard sheet opens in view, even with the page scrolled to its end.
            page.mouse.wheel(0, 5000)
            page.get_by_role("button", name="? Keyboard").click()
            sheet = page.locator(f"#{C.ID_ANN_CHEATSHEET} .ea-cheatsheet")
            expect(sheet).to_be_visible()
            box = sheet.bounding_box()
            assert 0 <= box["y"] and box["y"] + box["height"] <= 1000 and box["x"] + box["width"] <= 1400
            page.screenshot(path=str(tmp_path / "annotate-sheet.png"))
            page.get_by_role("button", name="? Keyboard").click()
            expect(sheet).to_be_hidden()

            # A typed instruction's branch says what annotating it is for.
            page.get_by_label("Diverged only").uncheck()  # the instruction ran without rehearsal
            page.locator(f"#{C.ID_ANN_PANEL}").get_by_label("Episode", exact=True).click()
            page.get_by_role("option", name=instruction).click()
            load.click()
            expect(page.get_by_text("Branch 1 of")).to_be_visible(timeout=TIMEOUT_MS)
            expect(page.get_by_text(INSTRUCTION_BRANCH_USE[:60], exact=False)).to_be_visible()
            page.screenshot(path=str(tmp_path / "annotate-instruction.png"))

            # The name stays for this browser: a new page (a reload) fills it in.
            page2 = context.new_page()
            page2.goto(url)
            page2.get_by_role("tab", name="Annotate").click()
            expect(page2.get_by_label("Annotator")).to_have_value("layout-test", timeout=TIMEOUT_MS)
            browser.close()
    finally:
        close_demo(demo)
