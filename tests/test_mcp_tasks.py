"""MCP tasks: the task files, the registry, the CLI listing, eval's --tasks groups, and every
task's reference solution replayed on its real server (the check fails before, passes after)."""
import json
import subprocess
import sys

import pytest

from app import envs
from app.envs import mcp_tasks
from app.envs.bfcl_tasks import parse_call_string
from app.eval.evaluation import resolve_tasks
from helpers import need_servers

pytestmark = pytest.mark.mcp

ROOT = mcp_tasks.TASKS_DIR.parents[1]


def test_every_server_has_about_ten_tasks_with_ids_by_server():
    assert mcp_tasks.servers() == ["filesystem", "git", "sqlite"]
    for server in mcp_tasks.servers():
        ids = envs.list_tasks(server, suite="mcp")
        assert 10 <= len(ids) <= 12 and all(i.startswith(f"mcp:{server}/") for i in ids)
    task = envs.load_task("mcp:git/commit-readme")
    assert task.category == "mcp:git" and task.turns[0][0]["content"].startswith("The repository is at '.'")
    assert task.ground_truth == [["git_add(repo_path='.', files=['README.md'])",
                                  "git_commit(repo_path='.', message='Update README')"]]
    assert parse_call_string(task.ground_truth[0][0]) == ("git_add", {"repo_path": ".", "files": ["README.md"]})


@pytest.mark.parametrize("task_id, message", [
    ("mcp:git/nope", "unknown task 'mcp:git/nope'; git has: commit-readme"),
    ("mcp:svn/commit", "unknown MCP server 'svn'; known: filesystem, git, sqlite"),
    ("mcp:git", "MCP ids look like mcp:<server>/<task>"),
])
def test_unknown_ids_say_what_exists(task_id, message):
    with pytest.raises(envs.UnknownTaskError) as info:
        envs.load_task(task_id)
    assert message in str(info.value)


def test_cli_lists_mcp_tasks_and_refuses_a_split():
    out = subprocess.run([sys.executable, "-m", "app", "tasks", "--suite", "mcp", "--category", "sqlite"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == envs.list_tasks("sqlite", suite="mcp")
    bad = subprocess.run([sys.executable, "-m", "app", "tasks", "--suite", "mcp", "--split", "heldout"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: MCP tasks have no heldout split"


def test_eval_task_groups():
    assert resolve_tasks("mcp:git") == envs.list_tasks("git", suite="mcp")
    assert resolve_tasks("mcp:git,mcp:sqlite/add-user", limit=12)[-1] == "mcp:sqlite/add-user"
    assert len(resolve_tasks("mcp")) == sum(len(f.tasks) for f in mcp_tasks.task_files().values())
    with pytest.raises(ValueError, match="mcp:git tasks have no heldout split"):
        resolve_tasks("mcp:git", split="heldout")


@pytest.mark.parametrize("bad, message", [
    ({"files": {"/etc/passwd": "x"}}, "must be relative"),
    ({"files": {"../out.txt": "x"}}, "must be relative"),
    ({"gitt": []}, "Extra inputs are not permitted"),
])
def test_setups_stay_inside_the_state_folder(bad, message):
    with pytest.raises(ValueError, match=message):
        mcp_tasks.Setup.model_validate(bad)


def test_a_task_file_with_a_wrong_check_is_refused(tmp_path, monkeypatch):
    spec = json.loads((mcp_tasks.TASKS_DIR / "mcp-git.json").read_text())
    spec["tasks"][0]["check"] = [{"kind": "file", "path": "a", "matches": "x"}]
    (tmp_path / "mcp-git.json").write_text(json.dumps(spec))
    monkeypatch.setattr(mcp_tasks, "TASKS_DIR", tmp_path)
    mcp_tasks.task_files.cache_clear()
    try:
        with pytest.raises(ValueError, match="mcp-git.json is not a valid MCP task file"):
            mcp_tasks.task_files()
    finally:
        monkeypatch.undo()
        mcp_tasks.task_files.cache_clear()


@pytest.mark.parametrize("server", ["git", "sqlite", "filesystem"])
def test_reference_solutions_pass_and_doing_nothing_fails(server):
    """One fresh server per task: the solution's calls succeed, the last turn's check passes; the
    same check on the untouched state fails (a task that passes by doing nothing would test nothing)."""
    need_servers()
    for task_id in envs.list_tasks(server, suite="mcp"):
        task = envs.load_task(task_id)
        with envs.make_env(task) as env:
            last = len(task.turns) - 1
            untouched = envs.make_judge(task)
            for turn in range(last):
                untouched.check_turn(turn, env, [])
            assert not untouched.check_turn(last, env, []).success, f"{task_id} passes without doing anything"
            judge = envs.make_judge(task)
            for turn, calls in enumerate(task.ground_truth):
                env.set_turn(turn)
                executed = []
                for text in calls:
                    name, args = parse_call_string(text, env.param_names)
                    result = env.call(name, args)
                    assert not result.error, f"{task_id}: {text} -> {result.output}"
                    executed.append((name, args, result.output))
                check = judge.check_turn(turn, env, executed)
            assert check.success, f"{task_id}: {check.details}"
            assert all(c["ok"] for c in check.details["checks"])


def test_a_failed_check_says_what_it_found():
    need_servers()
    task = envs.load_task("mcp:sqlite/deactivate-bob")
    with envs.make_env(task) as env:
        env.call("write_query", {"query": "UPDATE users SET active = 0 WHERE name = 'Alice'"})
        check = envs.make_judge(task).check_turn(0, env, [])
    assert not check.success and check.details["error_type"] == "mcp:state_check_failed"
    assert check.details["checks"][0]["got"] == [["Alice", 0], ["Bob", 1], ["Carol", 1]]


def test_free_instruction_runs_on_the_base_setup_unjudged():
    need_servers()
    task = mcp_tasks.free_task("git", "Show me the log.")
    assert task.id == "mcp:git/free" and task.turns == [[{"role": "user", "content": "Show me the log."}]]
    with envs.make_env(task) as env:
        assert "Initial commit" in env.call("git_log", {"repo_path": "."}).output["text"]
        check = envs.make_judge(task).check_turn(0, env, [])
    assert not check.success and check.details["judged"] is False
    with pytest.raises(ValueError, match="the instruction is empty"):
        mcp_tasks.free_task("git", "  ")


def test_eval_on_an_mcp_task_with_the_real_best_of_k_row(tmp_path):
    """The eval's rows on a real MCP task (scripted policy): parallel commits its best-judged call and
    shadows the other on a fork; best-of-K runs both for real on forks and commits the one whose
    state passes the check."""
    from app.eval.evaluation import EvalConfig, run_eval
    from app.store import Store
    from scripted import ScriptedPolicy
    from scripted import call

    need_servers()
    good = call("write_query", query="UPDATE users SET active = 0 WHERE name = 'Bob'")
    bad = call("write_query", query="UPDATE users SET active = 0")
    # The judge prefers the wrong call, so only the real outcome tells them apart.
    policy = ScriptedPolicy([[bad, good]] * 4, judge=lambda text: 0.9 if "WHERE" not in text else 0.2)
    cfg = EvalConfig(task_ids=["mcp:sqlite/deactivate-bob"], modes=["parallel"], branches=2, state_probe=0,
                     max_steps_per_turn=1, selector="judge")
    result = run_eval(cfg, Store(tmp_path / "eval.db"), policy)
    rows = {r["row"]: r for r in result["rows"]}
    assert rows["parallel"]["task_success"] == 0.0 and rows["parallel"]["shadow_calls_per_task"] == 1.0
    assert rows["best-of-K"]["task_success"] == 1.0 and rows["best-of-K"]["external_calls_per_task"] == 2.0
    assert rows["parallel"]["call_accuracy"] == 0.0 and rows["best-of-K"]["call_accuracy"] == 1.0


def test_the_run_tab_lists_mcp_tasks_and_runs_a_typed_instruction_on_a_server(tmp_path):
    # The service the Run tab calls: MCP tasks are in its catalog, and an instruction on `mcp:git`
    # runs on the server's base repository, recorded unjudged, its text shown again from the store.
    from app.records import RunSettings
    from app.service import ENV_CLASSES, RunRequest, RunSession, Services, task_turns
    from scripted import ScriptedPolicy

    need_servers()
    status = '<tool_call>{"name": "git_status", "arguments": {"repo_path": "."}}</tool_call>'
    services = Services(str(tmp_path / "ui.db"), policy_loader=lambda m, a: ScriptedPolicy([[status], ["Clean."]]))
    assert "mcp:git/commit-readme" in services.catalog.tasks and "mcp:git" in ENV_CLASSES
    request = RunRequest(task_id=None, instruction="Is the working tree clean?", env_class="mcp:git",
                         settings=RunSettings(mode="none", branches=1, selector="logprob", shadow=False))
    session = RunSession()
    try:
        first = session.step(services, request)
        second = session.step(services, request)
    finally:
        session.close(services)
    assert first.chosen_branch.call.name == "git_status" and not first.chosen_branch.actual_error
    assert "working tree clean" in json.dumps(first.chosen_branch.actual)
    assert second.kind == "answer"
    stored = services.store.get_episode(session.episode.id)
    assert stored.task_id == "mcp:git/free" and stored.status == "finished" and stored.success is None
    assert task_turns(stored.task_id, stored) == [[{"role": "user", "content": "Is the working tree clean?"}]]
