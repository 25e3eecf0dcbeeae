"""The real embedded model on real BFCL tasks: two parallel-rehearsal steps, stored in SQLite."""
import itertools
import json
import subprocess
import sys

import pytest

from app import envs
from app.engine import EpisodeRunner
from app.formats import HistoryItem, act_prompt, rehearse_prompt
from app.records import Call, RunSettings
from app.store import Recorder, Store

pytestmark = pytest.mark.slow


def test_two_parallel_steps_store_predicted_and_actual(base_policy, tmp_path):
    task = envs.load_task("bfcl:multi_turn_base_0")
    # tool_choice=required: every step is a tool call, whatever the weights prefer.
    settings = RunSettings(mode="parallel", branches=3, selector="judge", seed=0, tool_choice="required",
                           max_action_tokens=48, max_rehearsal_tokens=48)
    store = Store(tmp_path / "run.db")
    recorder = Recorder(store)
    runner = EpisodeRunner(task, base_policy, settings, on_step=recorder)
    recorder.start(runner.episode)
    steps = [runner.step(), runner.step()]
    assert all(s is not None for s in steps)

    rows = store.branch_rows(runner.episode.id)
    assert {r["step_idx"] for r in rows} == {0, 1}
    committed = [r for r in rows if r["chosen"]]
    assert len(committed) == 2
    for r in committed:
        assert r["actual_source"] == "committed" and r["actual"] is not None
    rehearsed = [r for r in rows if r["predicted_text"] is not None]
    assert rehearsed, "every call branch is rehearsed in parallel mode"
    assert all(r["predicted_text"].startswith("<execution_result>") for r in rehearsed)
    measured = [r for r in rows if r["actual_source"] and r["predicted_text"] is not None]
    assert all(r["surprise"] is not None and r["json_valid"] is not None for r in measured)

    ep = store.get_episode(runner.episode.id)
    assert ep.rehearsals == sum(s.rehearsals for s in steps) > 0
    assert ep.external_calls == sum(1 for s in steps if s.kind == "call")
    assert ep.shadow_calls == sum(1 for r in rows if r["actual_source"] == "shadow")


def test_same_seed_same_steps(base_policy):
    task = envs.load_task("bfcl:multi_turn_base_4")
    settings = RunSettings(mode="parallel", branches=2, seed=7, tool_choice="required",
                           max_action_tokens=32, max_rehearsal_tokens=32)

    def texts():
        step = EpisodeRunner(task, base_policy, settings).step()
        return [(b.action_text, b.predicted_text, b.chosen) for b in step.branches]

    assert texts() == texts()


def test_prompts_fit_the_context_window(base_policy):
    """Tools of any two BFCL classes plus ten steps of history fit with room to generate."""
    classes = sorted({c for tid in envs.list_tasks("multi_turn_base") for c in envs.load_task(tid).env_classes})
    history = [HistoryItem(role="user", content="Please do the following task for me. " * 8)]
    for i in range(10):
        call = Call(name="some_tool", arguments={"path": f"/a/b/file_{i}.txt", "n": i})
        history.append(HistoryItem(role="assistant", content=json.dumps(call.model_dump()), call=call))
        history.append(HistoryItem(role="tool", content="", result={"result": "x" * 600}))
    reserve = 256
    report = {}
    for a, b in itertools.combinations(classes, 2):
        env = envs.BFCLEnvironment([a, b])
        prompt = act_prompt(env.tools(), history, base_policy.count_tokens, base_policy.context_window, reserve=reserve)
        n = len(base_policy.encode(prompt))
        report[f"{a}+{b}"] = n
        assert n + reserve <= base_policy.context_window, (a, b, n)
        assert sum(1 for m in prompt.messages if m["role"] == "tool") == 10  # nothing had to be dropped
        r = rehearse_prompt(env.tools()[0], Call(name=env.tools()[0].name), history)
        assert len(base_policy.encode(r)) + reserve <= base_policy.context_window
    print("act prompt tokens, two classes + 10 steps:", json.dumps(report, indent=0))
    assert max(report.values()) < 4000


def test_cli_run_json(tmp_path):
    db = tmp_path / "cli.db"
    out = subprocess.run([sys.executable, "-m", "app", "run", "--task", "bfcl:multi_turn_base_8", "--mode",
                          "parallel", "--branches", "2", "--max-steps", "1", "--tool-choice", "required",
                          "--max-action-tokens", "40", "--max-rehearsal-tokens", "40",
                          "--db", str(db), "--json"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert {"episode_id", "task", "success", "steps", "external_calls", "shadow_calls", "rehearsals"} <= set(data)
    assert data["task"] == "bfcl:multi_turn_base_8"
    stored = Store(db).get_episode(data["episode_id"])
    assert isinstance(data["success"], bool) and data["success"] is stored.success  # BFCL judged it, as stored
    assert len(data["steps"]) == len(envs.load_task("bfcl:multi_turn_base_8").turns)  # one step per turn
    for b in data["steps"][0]["branches"]:
        assert {"call", "predicted", "actual", "actual_source", "chosen", "metrics"} <= set(b)
    assert stored.external_calls == data["external_calls"]
