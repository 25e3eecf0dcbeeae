"""`python -m app eval`: table math, resume, the real best-of-K baseline, breakdowns, bad input.

Fast tests drive a prompt-keyed scripted policy on the mock key-value task; one slow test
runs the real embedded model on two held-out BFCL tasks.
"""
import json
import time
from pathlib import Path

import pytest

from app import envs
from app.cli.main import main
from app.engine import EpisodeRunner
from app.engine.oracle import CALL_OK, TURN_PASSES, oracle_settings
from app.engine.rehearsers import ModelRehearser
from app.eval.report import figures, markdown, write_outputs
from app.eval.evaluation import BEST_OF_K, EvalConfig, resolve_tasks, run_eval, table_row
from app.records import RunSettings
from app.store import Store
from scripted import ScriptedPolicy


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# (turn, step within the turn) -> candidates, greedy first. Turn 0's greedy call is wrong
# (red); the judge and the oracle both prefer the blue alternative.
SCRIPT = {
    (0, 0): [call("set", key="color", value="red"), call("set", key="color", value="blue"), call("list_keys")],
    (0, 1): ["Done."],
    (1, 0): [call("delete", key="size"), call("get", key="color")],
    (1, 1): [call("get", key="color")],
    (1, 2): ["It is blue."],
}


def predict(text: str) -> dict:
    """Right for writes; reads are only right when the state snapshot is in view."""
    the_call = text.split("Call:")[-1]
    if '"set"' in the_call:
        return {"ok": True}
    if '"delete"' in the_call:
        return {"deleted": "size"}
    if "Environment state" in text and '"get"' in the_call:
        return {"value": "blue"}
    return {"value": "?"}


class PromptPolicy(ScriptedPolicy):
    """Candidates chosen by where the prompt stands (turn, step), so every row and rerun sees the same script."""

    def __init__(self, script=SCRIPT) -> None:
        super().__init__([], predict=predict, judge=lambda text: 0.9 if "blue" in text.split("Proposed")[-1] else 0.3)
        self.script = script

    def act(self, prompt, k, config):
        msgs = [m for m in prompt.messages[1:] if not m["content"].startswith("Private rehearsal")]
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        turn = len(users) - 1
        step = sum(1 for m in msgs[users[-1]:] if m["role"] == "assistant")
        self.actions = [self.script.get((turn, step), ["Done."])]
        return super().act(prompt, k, config)


def no_model():
    raise AssertionError("the model must not load")


def config(**overrides) -> EvalConfig:
    # relevance 0: the scripted candidates are the test's own (no tool ranking re-aims them); keep_primary off:
    # these tests check the selectors' arithmetic (test_keep_primary_commits_the_greedy_call_... checks the rule);
    # the history alone in Rehearse prompts: the scripted predictions read the prompt's last lines.
    values = dict(task_ids=["mock:kv"], modes=["none", "parallel", "sequential"], branches=3, model="scripted",
                  state_probe=8, relevance=0.0, keep_primary=False, rehearsal_context="history")
    values.update(overrides)
    return EvalConfig(**values)


def rows_by_key(result):
    return {r["row"]: r for r in result["rows"]}


def comparable(result):
    """The table without what legitimately changes between runs (ids, wall time, run bookkeeping)."""
    drop = {"episodes", "wall_s", "wall_s_per_task"}
    return {"rows": [{k: v for k, v in r.items() if k not in drop} for r in result["rows"]],
            "fidelity": result["fidelity"]}


# ---------------------------------------------------------------- table math


def test_table_rows_follow_the_episodes(tmp_path):
    store = Store(tmp_path / "e.db")
    result = run_eval(config(), store, PromptPolicy())
    rows = rows_by_key(result)
    assert list(rows) == ["none", "parallel", "sequential", BEST_OF_K]
    none, par, best = rows["none"], rows["parallel"], rows[BEST_OF_K]
    # none commits the greedy red: turn 0 fails, and turn 1 too (the state still differs from gold).
    assert (none["task_success"], none["turn_success"]) == (0.0, 0.0)
    assert (par["task_success"], par["turn_success"]) == (1.0, 1.0)
    assert (best["task_success"], best["turn_success"]) == (1.0, 1.0)
    # Judged steps with ground truth: set, Done, delete, get, answer = 5; 3 gold calls committed.
    assert none["call_accuracy"] == 0.4 and par["call_accuracy"] == 0.6
    assert none["external_calls_per_task"] == 3 and par["external_calls_per_task"] == 3
    assert none["rehearsals_per_task"] == 0 and none["exact"] is None
    # parallel: 3 + 2 + 1 rehearsed calls; shadow: the red set and list_keys at step 0 (writes run
    # on their own forks too), get at the delete step.
    assert par["rehearsals_per_task"] == 6 and par["shadow_calls_per_task"] == 3
    # best-of-K executes every candidate call for real: 3 + 2 + 1, and rehearses nothing.
    assert best["external_calls_per_task"] == 6 and best["rehearsals_per_task"] == 0
    assert best["shadow_calls_per_task"] == 0 and best["fidelity_n"] == 0
    for row in result["rows"]:
        assert row["n_tasks"] == 1 and row["wall_s"] >= 0


def test_numbers_equal_what_the_store_holds(tmp_path):
    store = Store(tmp_path / "e.db")
    result = run_eval(config(), store, PromptPolicy())
    for row in result["rows"]:
        episodes = [store.get_episode(i) for i in row["episodes"]]
        assert all(ep.status == "finished" for ep in episodes)
        ext = sum(s.external_calls for ep in episodes for s in ep.steps)
        committed_calls = sum(s.kind == "call" for ep in episodes for s in ep.steps)
        if row["row"] == BEST_OF_K:
            executed = sum(b.kind == "call" for ep in episodes for s in ep.steps for b in s.branches)
            assert ext == executed
        else:
            assert ext == committed_calls
        assert row["external_calls_per_task"] == ext / len(episodes)
        assert row["rehearsals_per_task"] == sum(s.rehearsals for ep in episodes for s in ep.steps) / len(episodes)
        measured = [b.metrics.exact for ep in episodes for s in ep.steps for b in s.branches
                    if b.metrics.json_valid is not None]
        assert row["fidelity_n"] == len(measured)
        assert table_row(episodes) | {"episodes": row["episodes"]} == {k: v for k, v in row.items()
                                                                        if k not in ("row", "settings")}


def test_same_seed_same_table_and_the_markdown_has_every_row(tmp_path):
    a = run_eval(config(), Store(tmp_path / "a.db"), PromptPolicy())
    b = run_eval(config(), Store(tmp_path / "b.db"), PromptPolicy())
    assert comparable(a) == comparable(b)
    text = markdown(a)
    for label in ("| none |", "| parallel (K=3, judge) |", "| sequential (K=3, judge) |", "| real best-of-K (K=3) |"):
        assert label in text


def test_the_report_says_how_a_model_server_kept_the_constraints(tmp_path):
    class Served(PromptPolicy):
        constraint_note = "constraints not kept by the server (it refused or ignored vllm): decoding free"

    cfg = config(modes=["none"], best_of_k=False, state_probe=0)
    served = run_eval(cfg, Store(tmp_path / "s.db"), Served())
    assert served["constraints"] == Served.constraint_note
    assert f"Model server: {Served.constraint_note}." in markdown(served)
    local = run_eval(cfg, Store(tmp_path / "l.db"), PromptPolicy())
    assert local["constraints"] == "" and "Model server:" not in markdown(local)


# ---------------------------------------------------------------- resume


def test_keep_primary_commits_the_greedy_call_unless_its_rehearsal_predicts_an_error(tmp_path):
    # The greedy red `set` is rehearsed as {"ok": true}: no predicted error, so the judge's preference for blue
    # does not move the commit; parallel then does what none does (and the table says so).
    result = run_eval(config(modes=["none", "parallel"], best_of_k=False, state_probe=0, keep_primary=True),
                      Store(tmp_path / "e.db"), PromptPolicy())
    none, par = rows_by_key(result)["none"], rows_by_key(result)["parallel"]
    assert (par["task_success"], par["turn_success"], par["call_accuracy"]) == (
        none["task_success"], none["turn_success"], none["call_accuracy"]) == (0.0, 0.0, 0.4)
    assert result["config"]["keep_primary"] is True and "keeps the greedy primary" in markdown(result)


def test_rerun_reads_finished_episodes_back_without_a_model(tmp_path):
    store = Store(tmp_path / "e.db")
    first = run_eval(config(state_probe=0), store, PromptPolicy())
    events = []
    second = run_eval(config(state_probe=0), store, no_model, progress=events.append)
    assert second["run"] == second["run"] | {"episodes_run": 0, "episodes_resumed": 4}
    assert [e.kind for e in events] == ["resumed"] * 4
    assert [r["episodes"] for r in second["rows"]] == [r["episodes"] for r in first["rows"]]
    assert comparable(first) == comparable(second)


def test_interrupted_eval_resumes_where_it_stopped(tmp_path):
    store = Store(tmp_path / "e.db")
    seen = []

    def stop_in_the_second_episode(event):
        seen.append(event)
        if event.kind == "step" and event.row == "parallel":
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_eval(config(state_probe=0), store, PromptPolicy(), progress=stop_in_the_second_episode)
    stored = {r["mode"]: r["status"] for r in store.list_episodes()}
    assert stored == {"none": "finished", "parallel": "stopped"}
    events = []
    result = run_eval(config(state_probe=0), store, PromptPolicy(), progress=events.append)
    assert result["run"]["episodes_resumed"] == 1 and result["run"]["episodes_run"] == 3
    assert [e.kind for e in events if e.kind != "step"] == ["resumed", "episode", "episode", "episode"]
    assert rows_by_key(result)["parallel"]["task_success"] == 1.0
    # The stopped episode stays in the store for inspection; the table uses the finished one.
    assert len(store.list_episodes(mode="parallel")) == 3  # stopped + parallel + best-of-K


def test_other_settings_do_not_resume(tmp_path):
    store = Store(tmp_path / "e.db")
    run_eval(config(modes=["none"], best_of_k=False, state_probe=0), store, PromptPolicy())
    result = run_eval(config(modes=["none"], best_of_k=False, state_probe=0, seed=1), store, PromptPolicy())
    assert result["run"]["episodes_run"] == 1
    result = run_eval(config(modes=["none"], best_of_k=False, state_probe=0, max_steps_per_turn=2), store,
                      PromptPolicy())
    assert result["run"]["episodes_run"] == 1


def test_max_turns_judges_the_first_turns_only(tmp_path):
    store = Store(tmp_path / "e.db")
    result = run_eval(config(modes=["none"], best_of_k=False, state_probe=0, max_turns=1), store, PromptPolicy())
    row = result["rows"][0]
    ep = store.get_episode(row["episodes"][0])
    assert ep.status == "stopped" and len(ep.turn_results) == 1
    assert (row["task_success"], row["turn_success"], row["external_calls_per_task"]) == (0.0, 0.0, 1.0)
    again = run_eval(config(modes=["none"], best_of_k=False, state_probe=0, max_turns=1), store, no_model)
    assert again["run"]["episodes_resumed"] == 1


# ---------------------------------------------------------------- best-of-K


def test_best_of_k_executes_every_candidate_and_commits_the_best_outcome():
    task = envs.load_task("mock:kv")
    runner = EpisodeRunner(task, PromptPolicy(), oracle_settings(RunSettings(branches=3)))
    step = runner.step()
    red, blue, keys = step.branches
    assert step.chosen == 1 and blue.chosen and blue.actual_source == "committed"
    assert blue.scores["oracle"] == TURN_PASSES and red.scores["oracle"] == CALL_OK
    assert red.actual_source == keys.actual_source == "shadow" and keys.actual == {"keys": ["size"]}
    assert (step.external_calls, step.shadow_calls, step.rehearsals) == (3, 0, 0)
    assert runner.env.state()["MockKV"]["store"] == {"size": "L", "color": "blue"}
    assert all(b.predicted_text is None for b in step.branches)


def test_best_of_k_prefers_ending_a_finished_turn_and_refuses_bad_settings():
    script = {**SCRIPT, (0, 0): [call("set", key="color", value="blue")], (0, 1): ["Done.", call("list_keys")]}
    runner = EpisodeRunner(envs.load_task("mock:kv"), PromptPolicy(script), oracle_settings(RunSettings(branches=2)))
    runner.step()
    step = runner.step()
    assert step.kind == "answer" and step.branches[0].scores["oracle"] == TURN_PASSES
    assert step.external_calls == 1 and runner.turn == 1  # list_keys ran on its fork, the answer was committed
    for bad in (RunSettings(mode="sequential", selector="oracle", shadow=False),  # oracle is parallel only
                RunSettings(mode="parallel", selector="oracle", shadow=True)):   # its forks are the agent's calls
        with pytest.raises(ValueError, match="oracle"):
            EpisodeRunner(envs.load_task("mock:kv"), PromptPolicy(), bad)
    with pytest.raises(ValueError, match="executes on forks"):  # the outcome needs real forks
        EpisodeRunner(envs.load_task("mock:kv"), PromptPolicy(), oracle_settings(RunSettings(branches=2)),
                      rehearser=ModelRehearser())


# ---------------------------------------------------------------- breakdowns


def test_fidelity_breakdowns_by_tool_access_and_state_snapshot(tmp_path):
    result = run_eval(config(modes=["parallel"], best_of_k=False), Store(tmp_path / "e.db"), PromptPolicy())
    fid = result["fidelity"]
    by_tool, by_access, probe = fid["by_tool"], fid["by_access"], fid["by_context"]
    assert set(by_tool) == {"set", "list_keys", "delete", "get"}
    assert by_tool["set"]["exact"] == 1.0 and by_tool["get"]["exact"] == 0.0
    assert set(by_access) == {"read-only", "state-changing"}
    assert by_access["state-changing"]["exact"] == 1.0 and by_access["read-only"]["exact"] == 0.0
    assert by_access["read-only"]["n"] + by_access["state-changing"]["n"] == result["rows"][0]["fidelity_n"]
    # Paired: the same calls, with and without the state; the scripted simulator needs the state for reads.
    assert probe["calls"] == probe["history"]["n"] == probe["history+state"]["n"] > 0
    assert probe["history+state"]["exact"] > probe["history"]["exact"]


def test_resolve_tasks():
    heldout = resolve_tasks("bfcl:multi_turn_base", "heldout", 2)
    assert heldout == ["bfcl:multi_turn_base_3", "bfcl:multi_turn_base_7"]
    assert resolve_tasks("bfcl:multi_turn_base_7, mock:kv,bfcl:multi_turn_base_7") == ["bfcl:multi_turn_base_7", "mock:kv"]
    assert len(resolve_tasks("multi_turn_miss_func")) == 200


# ---------------------------------------------------------------- CLI


@pytest.fixture
def scripted_model(monkeypatch):
    import app.cli.evaluate

    loads = []

    def load(spec, adapter):
        loads.append((spec, adapter))
        return PromptPolicy()
    monkeypatch.setattr(app.cli.evaluate, "load_policy_or_fail", load)
    return loads


def test_cli_writes_the_files_and_resumes(tmp_path, capsys, scripted_model):
    out, db = tmp_path / "out", tmp_path / "e.db"
    args = ["eval", "--tasks", "mock:kv", "--modes", "none,parallel", "-k", "2", "--out", str(out), "--db", str(db),
            "--state-probe", "4", "--tool-choice", "required"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| real best-of-K (K=2) |" in printed and "results.json" in printed
    for name in ("results.json", "results.md", "figures.html"):
        assert (out / name).stat().st_size > 0
    first = json.loads((out / "results.json").read_text())
    assert [r["row"] for r in first["rows"]] == ["none", "parallel", BEST_OF_K]
    assert all(r["settings"]["tool_choice"] == "required" for r in first["rows"])
    assert "plotly" in (out / "figures.html").read_text()[:5_000_000]
    assert main(args) == 0
    second = json.loads((out / "results.json").read_text())
    assert second["run"]["episodes_resumed"] == 3 and comparable(first) == comparable(second)


@pytest.mark.browser
def test_png_figures_are_drawn_by_kaleido_in_debian_chromium(tmp_path):
    result = run_eval(config(state_probe=0), Store(tmp_path / "e.db"), PromptPolicy())
    written = write_outputs(result, tmp_path / "out")
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(pngs) == len(figures(result)) > 0
    for path in pngs:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5_000


def test_without_a_browser_the_pngs_are_skipped_and_the_table_is_kept(tmp_path, monkeypatch, caplog):
    import plotly.io as pio
    from choreographer.browsers.chromium import ChromeNotFoundError

    def no_browser(figs, paths, **kwargs):
        Path(paths[0]).write_bytes(b"partial")  # a half-written file must not stay behind
        raise ChromeNotFoundError("Kaleido v1 and later requires Chrome to be installed.")
    monkeypatch.setattr(pio, "write_images", no_browser)
    result = run_eval(config(state_probe=0), Store(tmp_path / "e.db"), PromptPolicy())
    written = write_outputs(result, tmp_path / "out")
    assert [p.name for p in written] == ["results.json", "results.md", "figures.html"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["figures.html", "results.json", "results.md"]
    assert "PNG figures skipped: Kaleido v1 and later requires Chrome" in caplog.text


@pytest.mark.parametrize("args,message", [
    (["--tasks", "bfcl:multi_turn_base_9999"], "no BFCL task 'bfcl:multi_turn_base_9999'"),
    (["--tasks", "bfcl:multi_turn_nope"], "unknown BFCL task id 'bfcl:multi_turn_nope'"),
    (["--tasks", "nothing"], "unknown task id 'nothing'"),
    (["--tasks", "bfcl:multi_turn_miss_func_3", "--split", "train"], "not in the train split"),
    (["--tasks", "bfcl:multi_turn_base_0", "--split", "heldout"], "not in the heldout split"),
    (["--tasks", ","], "no task given"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--modes", "none,fast"], "unknown mode(s) fast"),
    (["--branches", "0"], "--branches"),
    (["--relevance", "9"], "--relevance"),
    (["--max-turns", "0"], "--max-turns must be at least 1"),
    (["--model", "foo:bar"], "unknown model spec 'foo:bar'"),
    (["--adapter", "/nonexistent/adapter"], "is not a LoRA adapter directory"),
    (["--out", "{file}/sub"], "is not a writable directory"),
])
def test_bad_input_is_one_line_exit_2_before_any_model(tmp_path, capsys, scripted_model, args, message):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["eval", "--out", str(tmp_path / "out"), "--db", str(tmp_path / "e.db")]
    argv += [a.replace("{file}", str(blocker)) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert scripted_model == []


# ---------------------------------------------------------------- the real model


@pytest.mark.slow
def test_real_model_eval_on_two_heldout_tasks(tmp_path, capsys):
    """none and parallel on two held-out tasks with small budgets; rerun into a fresh DB gives the same table."""
    def run(name):
        out, db = tmp_path / name, tmp_path / f"{name}.db"
        started = time.perf_counter()
        code = main(["eval", "--tasks", "bfcl:multi_turn_base", "--split", "heldout", "--limit", "2",
                     "--modes", "none,parallel", "-k", "2", "--selector", "logprob", "--max-steps", "1",
                     "--max-turns", "1", "--max-action-tokens", "24", "--max-rehearsal-tokens", "24",
                     "--state-probe", "2", "--seed", "3", "--out", str(out), "--db", str(db)])
        assert code == 0, capsys.readouterr().err
        return out, Store(db), time.perf_counter() - started

    out, store, seconds = run("first")
    for name in ("results.json", "results.md", "figures.html"):
        assert (out / name).is_file()
    result = json.loads((out / "results.json").read_text())
    assert result["tasks"] == ["bfcl:multi_turn_base_3", "bfcl:multi_turn_base_7"]
    assert [r["row"] for r in result["rows"]] == ["none", "parallel", BEST_OF_K]
    for row in result["rows"]:
        episodes = [store.get_episode(i) for i in row["episodes"]]
        assert [ep.task_id for ep in episodes] == result["tasks"]
        assert all(len(ep.turn_results) == 1 and len(ep.steps) == 1 for ep in episodes)
        committed_calls = sum(s.kind == "call" for ep in episodes for s in ep.steps)
        executed = sum(b.kind == "call" for ep in episodes for s in ep.steps for b in s.branches)
        expected = executed if row["row"] == BEST_OF_K else committed_calls
        assert row["external_calls_per_task"] * 2 == sum(ep.external_calls for ep in episodes) == expected
        assert row["rehearsals_per_task"] * 2 == sum(ep.rehearsals for ep in episodes)
        assert row["shadow_calls_per_task"] * 2 == sum(ep.shadow_calls for ep in episodes)
        assert row["turn_success"] == sum(t.success for ep in episodes for t in ep.turn_results) / 2
    assert result["fidelity"]["by_context"]["calls"] <= 2
    out2, _, _ = run("second")
    again = json.loads((out2 / "results.json").read_text())
    assert comparable(again) == comparable(result)
    print(f"real-model eval: {seconds:.0f} s for the first run")
