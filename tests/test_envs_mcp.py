"""MCP environments against real servers: mcp-server-git, mcp-server-sqlite, the npm filesystem server,
a streamable HTTP server (the SDK's MCPServer), and a stdio server that misbehaves on request.

The servers come from `make mcp-deps` (npm and a second virtual environment under `.mcp/`) and
`requirements-dev.txt`; a test whose server is missing is skipped, saying which and the command
that installs it.
"""
import gc
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from app import envs
from app.engine import EpisodeRunner
from app.engine.runner import NOT_EXECUTED_CANNOT_FORK
from app.envs.base import Judge, Task, TurnCheck
from app.envs.mcp import TEXT_RESPONSE, MCPEnvironment, MCPServerConfig, MCPStartError
from app.envs.mcp_state import git
from app.records import RunSettings
from helpers import free_port, need_servers, wait_until
from scripted import ScriptedPolicy

pytestmark = pytest.mark.mcp

SERVERS = Path(__file__).parent / "mcp_servers"
FAULTY = {"command": sys.executable, "args": [str(SERVERS / "faulty_server.py"), "{state}"]}


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}


@pytest.fixture
def no_new_processes():
    """Every server process a test starts is gone when it ends (the env closed or collected)."""
    before = children()
    yield
    gc.collect()
    left = children() - before
    assert not left, f"server processes left running: {[psutil.Process(p).cmdline() for p in left]}"


def call(text: str, **arguments) -> str:
    import json

    return f'<tool_call>{json.dumps({"name": text, "arguments": arguments})}</tool_call>'


# ---------------------------------------------------------------- tools and hints


@pytest.mark.parametrize("task_id, read_only, writing, structured", [
    ("mcp:git/commit-readme", "git_status", "git_commit", False),
    ("mcp:sqlite/add-user", "read_query", "write_query", False),
    ("mcp:filesystem/write-hello", "read_text_file", "write_file", True),
])
def test_tools_keep_their_schemas_and_hints(task_id, read_only, writing, structured, no_new_processes):
    need_servers()
    with envs.make_env(envs.load_task(task_id)) as env:
        tools = {t.name: t for t in env.tools()}
        assert tools[read_only].read_only and not tools[writing].read_only
        assert tools[writing].parameters["type"] == "object" and tools[writing].parameters["required"]
        # outputSchema, where the server gives one, is the response schema; else the {"text"} shape.
        assert (tools[writing].response != TEXT_RESPONSE) == structured
        assert env.forkable and all(t.env_class == task_id.split("/")[0] for t in tools.values())


# ---------------------------------------------------------------- forks on a copy


def test_git_fork_commits_on_a_copy_only(no_new_processes):
    need_servers()
    with envs.make_env(envs.load_task("mcp:git/commit-readme")) as env:
        root = env.state_dir
        fork = env.fork()
        assert fork.state_dir != root
        # The original's own path works on the fork (translated), and results speak of the original's path.
        assert not fork.call("git_add", {"repo_path": str(root), "files": ["README.md"]}).error
        done = fork.call("git_commit", {"repo_path": ".", "message": "on the fork"})
        assert not done.error and "committed" in done.output["text"]
        assert git(fork.state_dir, "log", "-1", "--format=%s") == "on the fork"
        assert git(root, "log", "--format=%s") == "Initial commit"  # on disk: untouched
        assert git(root, "status", "--porcelain") == "M README.md"
        assert env.state()["mcp:git"]["git"]["log"] == ["Initial commit"]
        copy = fork.state_dir
        fork.close()
        assert not copy.exists() and root.exists()
        assert fork.call("git_status", {"repo_path": "."}).output == {"error": "this MCP environment is closed"}
    assert not root.exists()  # the task's folder belongs to the environment


def test_sqlite_fork_writes_on_a_copy_only(no_new_processes):
    need_servers()
    with envs.make_env(envs.load_task("mcp:sqlite/deactivate-bob")) as env:
        fork = env.fork()
        out = fork.call("write_query", {"query": "DELETE FROM users"})
        assert not out.error and "affected_rows" in out.output["text"]
        count = lambda root: sqlite3.connect(root / "data.db").execute("SELECT count(*) FROM users").fetchone()[0]  # noqa: E731
        assert (count(fork.state_dir), count(env.state_dir)) == (0, 3)
        assert env.call("read_query", {"query": "SELECT count(*) AS n FROM users"}).output == {"text": "[{'n': 3}]"}
        # This server answers failures as plain text; the task file's error_prefixes make them errors.
        refused = env.call("read_query", {"query": "DELETE FROM users"})
        assert refused.error and refused.output["error"].startswith("Error: Only SELECT queries are allowed")
        broken = env.call("write_query", {"query": "UPDATE nowhere SET x = 1"})
        assert broken.error and broken.output == {"error": "Database error: no such table: nowhere"}
        fork.close()


def test_filesystem_fork_writes_on_a_copy_only(no_new_processes):
    need_servers()
    with envs.make_env(envs.load_task("mcp:filesystem/write-hello")) as env:
        fork = env.fork()
        written = fork.call("write_file", {"path": str(env.state_dir / "hello.txt"), "content": "fork"})
        assert written.output == {"content": f"Successfully wrote to {env.state_dir / 'hello.txt'}"}
        assert (fork.state_dir / "hello.txt").read_text() == "fork"
        assert not (env.state_dir / "hello.txt").exists()
        assert fork.state()["mcp:filesystem"]["files"]["hello.txt"] == "fork"
        assert "hello.txt" not in env.state()["mcp:filesystem"]["files"]
        # Outside the folder is refused by the server itself.
        assert env.call("read_text_file", {"path": "/etc/hostname"}).error
        fork.close()


def test_runner_shadow_executes_writes_on_forks_and_commits_one(no_new_processes):
    need_servers()
    task = envs.load_task("mcp:sqlite/deactivate-bob")
    env = envs.make_env(task)
    policy = ScriptedPolicy([[call("write_query", query="UPDATE users SET active = 0 WHERE name = 'Bob'"),
                              call("write_query", query="DELETE FROM users")]],
                            judge=lambda text: 0.9 if "Bob" in text else 0.1)
    runner = EpisodeRunner(task, policy, RunSettings(mode="parallel", branches=2, max_steps_per_turn=1), env=env)
    step = runner.step()
    shadow = step.branches[1 - step.chosen]
    assert step.branches[step.chosen].call.arguments["query"].endswith("'Bob'")
    assert shadow.actual_source == "shadow" and "affected_rows': 3" in shadow.actual["text"]
    assert [r[0] for r in sqlite3.connect(env.state_dir / "data.db").execute("SELECT name FROM users")] \
        == ["Alice", "Bob", "Carol"]  # the DELETE ran on a fork only
    assert runner.episode.turn_results[0].success  # the judge's check over the final state
    env.close()


# ---------------------------------------------------------------- bad input and misbehaving servers


def test_bad_input_is_an_error_result(no_new_processes):
    need_servers()
    with envs.make_env(envs.load_task("mcp:git/create-branch")) as env:
        unknown = env.call("git_push", {"repo_path": "."})
        assert unknown.error and unknown.output["error"].startswith("unknown tool 'git_push'; this server has: git_status")
        wrong = env.call("git_create_branch", {"repo_path": ".", "branch_name": 7})
        assert wrong.error and wrong.output == {"error": "invalid arguments for git_create_branch: branch_name: 7 is not of type 'string'"}
        missing = env.call("git_create_branch", {"repo_path": "."})
        assert missing.error and "'branch_name' is a required property" in missing.output["error"]
        assert env.call("git_status", ["."]).output == {"error": "arguments of git_status must be an object, got list"}
        outside = env.call("git_status", {"repo_path": "/"})
        assert outside.error and "outside the allowed repository" in outside.output["error"]


def test_a_misbehaving_server_gives_error_results_never_a_hang(tmp_path, no_new_processes):
    with MCPEnvironment.start({**FAULTY, "call_timeout_s": 1}, state_dir=tmp_path) as env:
        assert env.call("echo", {"text": "hi"}).output == {"text": "hi"}
        assert env.call("counter_add", {"by": 2}).output == {"count": 2}  # structuredContent
        slow = env.call("sleep", {"seconds": 3})
        assert slow.error and slow.output == {"error": "sleep did not answer within 1 s (time-out)"}
        malformed = env.call("malformed", {})
        assert malformed.error and "validation error" in malformed.output["error"] and "CallToolResult" in malformed.output["error"]
        bad = env.call("bad_structured", {})
        assert bad.error and "'seven' is not of type 'integer'" in bad.output["error"]
        crash = env.call("crash", {})
        assert crash.error and "closed the connection" in crash.output["error"]
        assert "faulty server: crashing on purpose" in crash.output["error"]  # its stderr, quoted
        after = env.call("echo", {"text": "still there?"})
        assert after.error and "closed the connection" in after.output["error"]
        env.close()  # idempotent (and again on leaving the block)


@pytest.mark.parametrize("config, message", [
    ({"command": "/nonexistent/mcp-server"}, "did not start: FileNotFoundError"),
    ({"command": sys.executable, "args": ["-c", "import sys; sys.stderr.write('no config file\\n'); sys.exit(3)"]},
     "server stderr: ...no config file"),
    ({"command": "sleep", "args": ["60"], "start_timeout_s": 1}, "did not answer within 1 s"),
])
def test_start_failures_raise_a_clear_error(config, message, no_new_processes):
    with pytest.raises(MCPStartError, match="MCP server .*") as info:
        MCPEnvironment.start(config)
    assert message in str(info.value)


def test_config_is_checked():
    with pytest.raises(ValueError, match="exactly one of `command`"):
        MCPServerConfig.model_validate({"args": ["x"]})
    with pytest.raises(ValueError, match="exactly one of `command`"):
        MCPServerConfig.model_validate({"command": "a", "url": "http://127.0.0.1:1/mcp"})
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        MCPServerConfig.model_validate({"command": "a", "argz": []})
    with pytest.raises(MCPStartError, match="uses {state} but the environment has no state folder"):
        MCPEnvironment.start({"command": "mcp-server-git", "args": ["--repository", "{state}"]})


# ---------------------------------------------------------------- processes


def test_closing_or_dropping_an_environment_ends_its_server(tmp_path):
    before = children()
    env = MCPEnvironment.start(FAULTY, state_dir=tmp_path)
    fork = env.fork()
    assert len(children() - before) == 2
    fork_dir = fork.state_dir
    del fork
    gc.collect()  # a dropped fork: its server and its copy go
    assert len(children() - before) == 1 and not fork_dir.exists()
    env.close()
    assert children() == before and tmp_path.exists()  # not owned: kept


# ---------------------------------------------------------------- streamable HTTP


@pytest.fixture
def http_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVERS / "http_server.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def listening() -> bool:
        if proc.poll() is not None:
            return pytest.fail("the HTTP MCP server exited")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return True
        except OSError:
            return False

    try:
        wait_until(listening, 30, interval=0.1, message="the HTTP MCP server did not come up")
    except AssertionError:
        proc.kill()
        raise
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


class _Unjudged(Judge):
    def check_turn(self, turn_index, env, executed):
        return TurnCheck(success=False, details={"judged": False})


def test_http_server_is_not_forkable_and_shadows_read_only_calls_only(http_server):
    env = MCPEnvironment.start({"url": http_server}, name="counter")
    assert not env.forkable and env.state() == {"counter": {}}
    tools = {t.name: t for t in env.tools()}
    assert tools["get_count"].read_only and not tools["add"].read_only
    task = Task(id="mcp:counter/free", category="mcp:counter", turns=[[{"role": "user", "content": "Add 2."}]],
                env_classes=["mcp:counter"], max_steps_per_turn=1)
    policy = ScriptedPolicy([[call("add", by=2), call("add", by=5), call("get_count")]],
                            judge=lambda text: 0.9 if '"by": 2' in text else 0.1)
    runner = EpisodeRunner(task, policy, RunSettings(mode="parallel", branches=3), env=env, judge=_Unjudged())
    step = runner.step()
    by_args = {str(b.call.arguments): b for b in step.branches}
    assert by_args["{'by': 2}"].chosen and by_args["{'by': 2}"].actual_source == "committed"
    assert by_args["{'by': 5}"].actual_source is None and by_args["{'by': 5}"].not_executed == NOT_EXECUTED_CANNOT_FORK
    assert by_args["{}"].actual_source == "shadow"  # read-only: ran on a second session
    # The shadow read ran before the commit, on the same backend: the add of 5 never ran.
    assert env.call("get_count", {}).output == {"text": '{\n  "count": 2\n}'}
    env.close()


def test_a_process_that_exits_without_closing_ends_its_servers(tmp_path):
    script = ("import sys; from app.envs.mcp import MCPEnvironment; import psutil\n"
              f"env = MCPEnvironment.start({FAULTY!r}, state_dir={str(tmp_path / 'state')!r}, owns_state=True)\n"
              "print(*[p.pid for p in psutil.Process().children()])\n")
    (tmp_path / "state").mkdir()
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parents[1], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 1 and not psutil.pid_exists(pids[0])
    assert not (tmp_path / "state").exists()  # owned: deleted at exit
