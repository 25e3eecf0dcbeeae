"""Eight people on one server: eight real browser contexts (Chromium), each on its own task, each
pressing Step twice in quick succession, with the real embedded model behind Gradio's queue.

Checked: each page shows only its own episode; every episode in SQLite is complete (steps
numbered without gaps, one committed branch per step); Step is disabled while its step runs, so
the second press waits and makes exactly the second step of the same episode. Queue waits (time from the press to the step's
result, less the step's own duration) are printed; `make reliability` records them in
bench/results/reliability.json ($ENVACE_RELIABILITY_JSON; the test writes no tracked file otherwise).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time
from pathlib import Path

import pytest

from app import envs
from app.config import shipped_adapter
from app.ui import build_demo, close_demo
from browser import launch
from helpers import gradio_queue_idle, wait_until
from app.ui import constants as C

CONTEXTS = 8
STEPS = 2  # two presses each, the second made while the first step runs
RESULTS = os.environ.get("ENVACE_RELIABILITY_JSON")  # set by `make reliability`

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def drive(url: str, task_id: str, out: dict, errors: list) -> None:
    """One person: open the page, pick a task, small budgets, press Step twice in quick succession, wait."""
    from playwright.sync_api import expect, sync_playwright

    try:
        with sync_playwright() as p:
            browser = launch(p, nice=True)  # the server, not eight repainting pages, gets the cores
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(300_000)  # eight browsers and the model on two cores: setup clicks can be slow
            page.goto(url)
            task = page.get_by_label("Task", exact=True)
            task.click()
            task.fill(f"{task_id} ·")
            page.get_by_role("option", name=f"{task_id} ·").first.click()
            page.get_by_label("none", exact=True).check()  # no rehearsal: the queue is what is under test
            page.get_by_text("Advanced").click()
            page.get_by_label("Selector").click()
            page.get_by_role("option", name="logprob").click()
            page.get_by_label("Max action tokens").fill("8")
            page.get_by_label("Max rehearsal tokens").fill("8")
            status = page.locator(f"#{C.ID_RUN_STATUS}")
            step = page.get_by_role("button", name=C.STEP, exact=True)
            latencies = []
            pressed = time.monotonic()
            step.click()
            # The press disables Step until its step ends; wait until it has (or the step already ended), then
            # press again at once, as an impatient person does: the click waits for the button, so the second
            # press becomes the second step, never a hidden extra one or a refusal.
            wait_until(lambda: step.is_disabled() or ", 1 step(s)" in status.inner_text(), 600, interval=0.1,
                       message="the first press neither disabled Step nor finished")
            step.click(timeout=600_000)
            latencies.append(time.monotonic() - pressed)  # Step is enabled again: the first step ended
            pressed = time.monotonic()
            expect(status).to_contain_text(f", {STEPS} step(s)", timeout=600_000)
            latencies.append(time.monotonic() - pressed)
            expect(step).to_be_enabled(timeout=120_000)
            text = status.inner_text()
            out[task_id] = {"episode": re.search(r"Episode\s+`?(\w+)", text).group(1),
                            "shown_steps": int(re.search(r"(\d+) step\(s\)", text).group(1)),
                            "latencies": latencies}
            browser.close()
    except Exception as exc:  # reported by the test, with the task it happened on
        errors.append(f"{task_id}: {exc}")


def test_eight_sessions_at_once_see_only_their_own_complete_episodes(tmp_path) -> None:
    demo = build_demo(db_path=str(tmp_path / "eight.db"))
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    demo.services.policy("embedded", shipped_adapter())  # the Run tab's default, loaded before the crowd arrives
    tasks = envs.list_tasks("multi_turn_base", "heldout")[:CONTEXTS]
    out: dict = {}
    errors: list = []
    try:
        threads = [threading.Thread(target=drive, args=(url, t, out, errors)) for t in tasks]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
        # Nothing left running that could still add a step the pages did not show.
        wait_until(lambda: gradio_queue_idle(demo), 600, interval=0.5, message="the queue never emptied")
    finally:
        close_demo(demo)
    assert errors == [], "\n".join(errors)
    store = demo.services.store
    rows = store.list_episodes()
    assert sorted(r["task_id"] for r in rows) == sorted(tasks)  # one episode per person: no double press made two
    waits, durations = [], []
    for task_id, seen in out.items():
        ep = store.get_episode(seen["episode"])
        assert ep.task_id == task_id  # the page shows its own episode, not a neighbour's
        assert len(ep.steps) == seen["shown_steps"] == STEPS  # two presses, two steps: none lost, none extra
        assert [s.index for s in ep.steps] == list(range(len(ep.steps)))
        assert all(sum(b.chosen for b in s.branches) == 1 for s in ep.steps)
        for latency, s in zip(seen["latencies"], ep.steps):
            durations.append(s.duration_s)
            waits.append(max(0.0, latency - s.duration_s))
    waits.sort()
    figures = {"contexts": CONTEXTS, "steps_each": STEPS, "wall_s": round(wall, 1),
               "step_s_p50": round(statistics.median(durations), 2),
               "queue_wait_s_p50": round(statistics.median(waits), 2),
               "queue_wait_s_p95": round(waits[int(0.95 * (len(waits) - 1))], 2)}
    print(figures)
    if RESULTS:
        path = Path(RESULTS)
        data = json.loads(path.read_text()) if path.exists() else {}
        data["concurrent_sessions"] = figures
        path.write_text(json.dumps(data, indent=2) + "\n")
