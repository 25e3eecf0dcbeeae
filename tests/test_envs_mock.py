"""The mock key-value environment, its task and judge, and the registry by id prefix."""
from __future__ import annotations

import json

import pytest

from app.envs import (
    MOCK_TASK_ID,
    BFCLEnvironment,
    BFCLJudge,
    Environment,
    MockEnvironment,
    MockJudge,
    UnknownTaskError,
    list_tasks,
    load_task,
    make_env,
    make_judge,
    mock_task,
    parse_call_string,
)


def _run(env: MockEnvironment, calls: list[str]) -> list[tuple]:
    executed = []
    for call in calls:
        name, args = parse_call_string(call, env.param_names)
        executed.append((name, args, env.call(name, args)))
    return executed


def test_tools_and_protocol() -> None:
    env = MockEnvironment()
    assert isinstance(env, Environment)
    tools = {t.name: t for t in env.tools()}
    assert set(tools) == {"get", "set", "delete", "list_keys", "fail"}
    assert {n for n, t in tools.items() if t.read_only} == {"get", "list_keys"}
    assert env.get_tool("nope") is None


def test_calls() -> None:
    env = MockEnvironment({"store": {"a": 1}})
    assert env.call("set", {"key": "b", "value": [1, {"x": None}]}).output == {"ok": True}
    assert env.call("get", {"key": "b"}).output == {"value": [1, {"x": None}]}
    assert env.call("list_keys", {}).output == {"keys": ["a", "b"]}
    assert env.call("delete", {"key": "a"}).output == {"deleted": "a"}
    assert env.state() == {"MockKV": {"store": {"b": [1, {"x": None}]}}}
    missing = env.call("get", {"key": "a"})
    assert missing.error and "no such key" in missing.output["error"]


@pytest.mark.parametrize(
    "name,args",
    [
        ("nope", {}),
        ("get", {}),
        ("get", {"key": 3}),
        ("set", {"key": "a"}),
        ("list_keys", {"extra": 1}),
        ("delete", {"key": "absent"}),
        ("fail", {}),
        ("get", "a"),
    ],
)
def test_errors_are_results_and_change_nothing(name: str, args: dict) -> None:
    env = MockEnvironment({"store": {"a": 1}})
    before = env.state()
    result = env.call(name, args)
    assert result.error and isinstance(result.output["error"], str)
    json.dumps(result.output)
    assert env.state() == before


def test_fork_is_independent() -> None:
    env = MockEnvironment({"store": {"a": 1}})
    fork = env.fork()
    fork.call("set", {"key": "a", "value": 2})
    fork.call("delete", {"key": "a"})
    assert env.state() == {"MockKV": {"store": {"a": 1}}}
    assert fork.state() == {"MockKV": {"store": {}}}


def test_stored_values_are_detached() -> None:
    env = MockEnvironment()
    value = [1, 2]
    env.call("set", {"key": "l", "value": value})
    value.append(3)
    got = env.call("get", {"key": "l"}).output["value"]
    got.append(4)
    assert env.state()["MockKV"]["store"]["l"] == [1, 2]


def test_mock_task_and_judge_accept_ground_truth() -> None:
    task = mock_task()
    assert len(task.turns) == 2 and len(task.ground_truth) == 2
    env, judge = make_env(task), make_judge(task)
    assert isinstance(env, MockEnvironment) and isinstance(judge, MockJudge)
    for turn, calls in enumerate(task.ground_truth):
        env.set_turn(turn)
        check = judge.check_turn(turn, env, _run(env, calls))
        assert check.success and check.state_ok and check.response_ok


def test_mock_judge_catches_wrong_state_and_missing_result() -> None:
    task = mock_task()
    env, judge = make_env(task), MockJudge(task)
    wrong = judge.check_turn(0, env, _run(env, ["set(key='color', value='red')"]))
    assert not wrong.success and not wrong.state_ok
    assert wrong.details["error_type"] == "multi_turn:instance_state_mismatch"

    env, judge = make_env(task), MockJudge(task)
    assert judge.check_turn(0, env, _run(env, task.ground_truth[0])).success
    # Turn 1 wants the colour read back: deleting alone leaves the state right but the answer missing.
    partial = judge.check_turn(1, env, _run(env, ["delete(key='size')"]))
    assert partial.state_ok and not partial.response_ok and not partial.success
    assert partial.details["missing_results"] == [{"value": "blue"}]


def test_mock_judge_counts_results_from_earlier_turns() -> None:
    """As in BFCL, a result fetched in an earlier turn satisfies a later turn's response check."""
    task = mock_task()
    env, judge = make_env(task), MockJudge(task)
    first = _run(env, task.ground_truth[0] + ["get(key='color')"])
    assert judge.check_turn(0, env, first).success
    assert judge.check_turn(1, env, _run(env, ["delete(key='size')"])).success


def test_registry() -> None:
    assert load_task(MOCK_TASK_ID).id == MOCK_TASK_ID
    assert list_tasks(suite="mock") == [MOCK_TASK_ID]
    task = load_task("bfcl:multi_turn_base_1")
    assert isinstance(make_env(task), BFCLEnvironment) and isinstance(make_judge(task), BFCLJudge)
    for bad in ["mock:other", "kv", "tau2:airline_1"]:
        with pytest.raises(UnknownTaskError):
            load_task(bad)
    with pytest.raises(UnknownTaskError):
        list_tasks(suite="nope")
