"""A real serving engine end to end: llama-cpp-python's OpenAI server on the embedded model's GGUF file.

Not part of `make test` (the engine lives in its own environment, `.venv-bench`): `make check-engines` builds that
environment and runs this module with `--engines`; without the flag conftest deselects it. What it checks through
`openai:<url>#SmolLM2-135M-Instruct`: the constraint form `auto` settles on and that every constrained answer fits,
the generated and the echoed prompt's log-probabilities, an episode in the CLI (K=4, constrained calls and
rehearsals, the logprob selector), a step in the browser (the Run tab's defaults: the judge and tool relevance,
which need prompt log-probabilities), and the step time at K=1 and K=4 against the local backend on the same
weights. It writes what it found to $ENVACE_ENGINES_JSON (bench/results/engines.json under `make check-engines`).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from model_backend.spec import EMBEDDED_NAME

pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parent.parent
BENCH_PYTHON = Path(os.environ.get("ENVACE_BENCH_PYTHON", ROOT / ".venv-bench" / "bin" / "python"))
REPORT: dict[str, Any] = {}
STEP_TIMEOUT_MS = 1_800_000
"""A step through llama-cpp-python with a grammar: its sampler checks the grammar against the whole vocabulary before
top-k, at each token (llama_cpp/llama.py `_init_sampler`): tens of seconds on 2 idle cores, many minutes on a shared
machine."""
BUDGETS = ("--max-action-tokens", "40", "--max-rehearsal-tokens", "32")


@pytest.fixture(scope="module")
def llama() -> tuple[str, str]:
    """(base URL, spec) of llama-cpp-python serving the embedded GGUF under the embedded model's name (so the
    inspector renders the chat template with the embedded tokenizer and sends `/v1/completions`)."""
    import served

    from model_backend.loading import embedded_gguf_path

    if not BENCH_PYTHON.exists():
        pytest.fail(f"{BENCH_PYTHON} is missing: run `make check-engines` (it builds .venv-bench)")
    version = subprocess.run([str(BENCH_PYTHON), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, timeout=120)
    if version.returncode != 0:
        pytest.fail(f"llama_cpp does not import in {BENCH_PYTHON}: {version.stderr.strip()[-300:]}")
    started = time.perf_counter()
    try:
        proc, url, log = served.start_llama_cpp(BENCH_PYTHON, embedded_gguf_path(), EMBEDDED_NAME)
    except served.ServeError as exc:
        pytest.fail(str(exc))
    REPORT["engine"] = {"name": "llama-cpp-python", "version": version.stdout.strip(),
                        "gguf": embedded_gguf_path().name, "startup_s": round(time.perf_counter() - started, 2)}
    try:
        yield url, f"openai:{url}#{EMBEDDED_NAME}?timeout=600"
    finally:
        served.stop(proc)
        from cpu_info import cpu_summary

        REPORT["machine"] = cpu_summary()
        out = os.environ.get("ENVACE_ENGINES_JSON")
        if out:
            Path(out).write_text(json.dumps(REPORT, indent=2) + "\n")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=3000,
                          cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def test_what_the_engine_gives(llama: tuple[str, str]) -> None:
    """Constraints kept in the GBNF form (the JSON-schema fields are not read on /v1/completions), generated and
    prompt log-probabilities, K=4 as concurrent requests (it answers one choice for `n`)."""
    import model_backend
    from app.envs import load_task, make_env
    from app.formats import (ACT_STOP, REHEARSE_STOP, TOOL_CALL_OPEN, HistoryItem, act_prompt, parse_action,
                             parse_result, rehearse_prompt)
    from model_backend.base import GenerationConfig

    _, spec = llama
    policy = model_backend.load_policy(spec)
    assert policy.prompt_mode == "completions"
    task = load_task("mock:kv")
    tools = make_env(task).tools()
    history = [HistoryItem(role="user", content=task.turns[0][0]["content"])]
    prompt = act_prompt(tools, history, policy.count_tokens, policy.context_window, prefill=TOOL_CALL_OPEN,
                        constrain=True)
    assert prompt.constraint is not None
    gens = policy.act(prompt, 4, GenerationConfig(max_new_tokens=40, temperature=0.8, seed=0, stop=ACT_STOP))
    assert len(gens) == 4 and not gens[0].sampled and all(g.sampled for g in gens[1:])
    assert policy.constraints.form == "gbnf", policy.constraints
    parsed = [parse_action(g.text) for g in gens]
    assert all(p.call is not None and p.call.name in {t.name for t in tools} for p in parsed if gens[0].finished), \
        [g.text for g in gens]
    assert policy.caps.logprobs is True and gens[0].token_logprobs and all(v <= 0 for v in gens[0].token_logprobs)
    call = parsed[0].call
    rp = rehearse_prompt(next(t for t in tools if t.name == call.name), call, history, constrain=True)
    [rehearsal] = policy.rehearse([rp], GenerationConfig(max_new_tokens=32, stop=REHEARSE_STOP))
    value, error = parse_result(rehearsal.text)
    assert error is None, rehearsal.text
    held, broken = policy.constraints.counts["gbnf"]
    assert broken == 0 and held >= 2
    assert policy.supports_scoring is True
    [scores] = policy.score([prompt], ['{"name": "get", "arguments": {"key": "size"}}'])
    assert scores and all(math.isfinite(v) and v <= 0 for v in scores)
    REPORT["capabilities"] = {
        "constraint_form": policy.constraints.form, "constraint_forms_dropped": policy.constraints.dropped,
        "constraint_note": policy.constraint_note, "n": policy.caps.n, "logprobs": policy.caps.logprobs,
        "prompt_logprobs": policy.caps.prompt_logprobs, "act_texts": [g.text for g in gens],
        "rehearsal": rehearsal.text}


def test_an_episode_in_the_cli(llama: tuple[str, str], tmp_path: Path) -> None:
    """K=4, constrained calls and rehearsals, the logprob selector: every call parses and every rehearsal is JSON;
    prompt log-probabilities give each rehearsal its surprise. Tool relevance off here (the browser step has it):
    it scores every tool at every step, which more than doubled the episode on a shared machine."""
    from app.store import Store

    _, spec = llama
    db = tmp_path / "engine.db"
    started = time.perf_counter()
    out = run_cli("run", "--task", "mock:kv", "--model", spec, "-k", "4", "--selector", "logprob", "--relevance", "0",
                  "--tool-choice", "required", "--max-steps", "1", *BUDGETS, "--db", str(db), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    ep = Store(str(db)).get_episode(summary["episode_id"])
    assert ep.status == "finished" and ep.model == spec and ep.steps
    calls = [b for s in ep.steps for b in s.branches if b.kind == "call"]
    assert all(len(s.branches) >= 1 and s.branches[s.chosen].chosen for s in ep.steps)
    assert calls and all(b.parse_error is None for s in ep.steps for b in s.branches)
    assert all(b.predicted_text is not None and b.predicted_text.startswith("<execution_result>") for b in calls)
    assert all(b.metrics.surprise is not None for b in calls if b.predicted is not None)
    REPORT["cli_episode"] = {"seconds": round(time.perf_counter() - started, 1), "steps": len(ep.steps),
                             "branches": [len(s.branches) for s in ep.steps], "success": summary["success"],
                             "calls": [b.action_text for s in ep.steps for b in s.branches]}


def test_a_step_in_the_browser(llama: tuple[str, str], tmp_path: Path) -> None:
    """The Run tab with its default selector (judge) and tool relevance, K=4, tool choice required, through the same
    spec: the step's calls constrained (the model line says `gbnf`), judged, rehearsed."""
    from playwright.sync_api import expect, sync_playwright

    from app.ui import build_demo, close_demo
    from app.ui import constants as C
    from browser import launch
    from helpers import wait_until

    _, spec = llama
    demo = build_demo(db_path=str(tmp_path / "ui.db"))
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    started = time.perf_counter()
    try:
        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(60_000)
            page.goto(url)
            # The model first: a change of the form prepares (and computes ahead) the step with what it says, and
            # the embedded model computing ahead a step nobody asked for would hold the 2 cores for minutes.
            model = page.get_by_label("Model", exact=True).filter(visible=True).first  # the Traces tab has one too
            model.click()
            model.fill(spec)
            model.press("Enter")
            adapter = page.get_by_label("Adapter (LoRA)")  # the shipped adapter by default: a server serves its own
            adapter.click()
            adapter.fill(C.NO_ADAPTER)
            adapter.press("Enter")
            task = page.get_by_label("Task", exact=True)
            task.click()
            task.fill("mock:kv")
            task.press("Enter")
            page.get_by_label("K (branches)").fill("4")
            page.get_by_text("Advanced").click()
            page.get_by_label("Max action tokens").fill("40")
            page.get_by_label("Max rehearsal tokens").fill("32")
            # Every step a call (the 135M model answers in text at `auto`, and text says nothing about the grammar)
            page.get_by_role("radio", name="required", exact=True).check()
            page.get_by_role("button", name=C.STEP, exact=True).click()
            status, message = page.locator(f"#{C.ID_RUN_STATUS}"), page.locator(f"#{C.ID_RUN_MESSAGE}")

            def stepped() -> bool:  # a refusal ends the wait at once, with what the page said
                assert "ea-msg-error" not in message.inner_html(), message.inner_text()
                return ", 1 step(s)" in status.inner_text()

            wait_until(stepped, STEP_TIMEOUT_MS / 1000, interval=1.0)
            expect(status).to_contain_text("constraints sent as gbnf")
            line = status.inner_text()
            cards = page.locator(f"#{C.ID_CARDS}").inner_text()
            browser.close()
        [row] = demo.services.store.list_episodes()
        episode = demo.services.store.get_episode(row["id"])
        step = episode.steps[0]
        assert episode.model == spec and episode.settings.selector == "judge" and episode.settings.relevance > 0
        assert len(step.branches) >= 2 and all("judge" in b.scores for b in step.branches if b.kind == "call")
        assert "Predicted" in cards and "✓ committed" in cards
        REPORT["browser_step"] = {"seconds": round(time.perf_counter() - started, 1), "model_line": line,
                                  "branches": len(step.branches), "selector": episode.settings.selector,
                                  "relevance": episode.settings.relevance}
    finally:
        close_demo(demo)


def test_step_time_against_the_local_backend(llama: tuple[str, str]) -> None:
    """One step of the same task at K=1 and K=4, through llama.cpp and through the local backend on the same
    weights (the GGUF converted), the logprob selector, every call rehearsed; measured, not asserted on."""
    import model_backend
    from app import envs
    from app.engine import EpisodeRunner
    from app.records import RunSettings

    _, spec = llama
    task = envs.load_task("bfcl:multi_turn_base_0")
    backends = {"llama.cpp (llama-cpp-python)": model_backend.load_policy(spec),
                "local (embedded)": model_backend.load_policy("embedded")}
    rows = []
    for k in (1, 4):
        for name, policy in backends.items():
            settings = RunSettings(mode="parallel", branches=k, selector="logprob", seed=0, tool_choice="required",
                                   max_action_tokens=40, max_rehearsal_tokens=32)
            runner = EpisodeRunner(task, policy, settings)
            started = time.perf_counter()
            step = runner.step()
            wall = time.perf_counter() - started
            assert step is not None and step.branches
            rows.append({"backend": name, "k": k, "step_s": round(wall, 2), "branches": len(step.branches),
                         "rehearsals": step.rehearsals, "chosen": step.branches[step.chosen].action_text})
            print(f"{name} K={k}: {wall:.1f} s")
    REPORT["step_time"] = {"task": "bfcl:multi_turn_base_0 (first step)", "mode": "parallel", "selector": "logprob",
                           "tool_choice": "required", "max_action_tokens": 40, "max_rehearsal_tokens": 32,
                           "rows": rows}
