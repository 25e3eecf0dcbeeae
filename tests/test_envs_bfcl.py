"""The BFCL multi-turn adapter: tasks, tools, the call boundary, forks and the judge."""
from __future__ import annotations

import inspect
import json
import pickle

import pytest

from app.envs import (
    CATEGORIES,
    READ_ONLY_TOOLS,
    BFCLEnvironment,
    BFCLJudge,
    Environment,
    UnknownTaskError,
    list_tasks,
    load_task,
    make_env,
    make_judge,
    parse_call_string,
    replay_ground_truth,
)
from app.envs.bfcl import _api_class
from app.envs.bfcl_tasks import class_tools


def _run_gold(env: BFCLEnvironment, calls: list[str]) -> list[tuple]:
    executed = []
    for call in calls:
        name, args = parse_call_string(call, env.param_names)
        executed.append((name, args, env.call(name, args)))
    return executed


JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _schema_types(schema: object) -> set[str]:
    """Every `type` named anywhere in a schema."""
    found: set[str] = set()
    if isinstance(schema, dict):
        if isinstance(schema.get("type"), str):
            found.add(schema["type"])
        for value in schema.values():
            found |= _schema_types(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= _schema_types(value)
    return found


# -- tasks and splits ---------------------------------------------------------------

@pytest.mark.parametrize("category", CATEGORIES)
def test_list_tasks_has_200_per_category(category: str) -> None:
    ids = list_tasks(category=category)
    assert len(ids) == 200 and len(set(ids)) == 200
    assert ids[0] == f"bfcl:{category}_0"


def test_list_tasks_splits() -> None:
    """Every category is split by the scenario's index (the four are variants of the same 200 scenarios), so a
    held-out scenario is held out in all of them."""
    train, heldout = list_tasks(split="train"), list_tasks(split="heldout")
    assert (len(train), len(heldout)) == (600, 200)
    assert all(int(t.rsplit("_", 1)[1]) % 4 == 3 for t in heldout)
    assert not set(train) & set(heldout)
    for category in CATEGORIES:
        cat_train, cat_heldout = list_tasks(category, "train"), list_tasks(category, "heldout")
        assert (len(cat_train), len(cat_heldout)) == (150, 50)
        assert [t.rsplit("_", 1)[1] for t in cat_heldout] == [str(i) for i in range(3, 200, 4)]
        assert load_task(cat_heldout[0]).extra["split"] == "heldout"
    assert len(list_tasks()) == 800


@pytest.mark.parametrize(
    "bad_id", ["bfcl:multi_turn_base_200", "bfcl:multi_turn_nope_1", "bfcl:base_1", "nope:x", "multi_turn_base"]
)
def test_unknown_task_id_raises(bad_id: str) -> None:
    with pytest.raises(UnknownTaskError, match="multi_turn_miss_func"):
        load_task(bad_id)


def test_unknown_category_raises() -> None:
    with pytest.raises(UnknownTaskError, match="multi_turn_long_context"):
        list_tasks(category="multi_turn_nope")
    with pytest.raises(ValueError):
        list_tasks(split="test")


def test_load_task_fields() -> None:
    task = load_task("bfcl:multi_turn_base_0")
    assert task.id == "bfcl:multi_turn_base_0" and task.category == "multi_turn_base"
    assert task.env_classes == ["TwitterAPI", "GorillaFileSystem"]
    assert task.excluded_functions == ["cp"]
    assert len(task.turns) == len(task.ground_truth) and task.turns[0][0]["role"] == "user"
    assert task.max_steps_per_turn == max(4, 2 * max(len(t) for t in task.ground_truth))
    assert task.extra["split"] == "train" and load_task("bfcl:multi_turn_base_3").extra["split"] == "heldout"
    assert load_task("bfcl:multi_turn_long_context_9").extra["long_context"] is True
    # A Task is a copy: mutating it leaves the cache intact.
    task.turns.clear()
    assert load_task("bfcl:multi_turn_base_0").turns


# -- tools --------------------------------------------------------------------------

@pytest.mark.parametrize("class_name", sorted(READ_ONLY_TOOLS))
def test_class_tools_are_clean_and_match_the_source(class_name: str) -> None:
    tools = class_tools(class_name)
    names = {t.name for t in tools}
    assert READ_ONLY_TOOLS[class_name] <= names  # no typo in the curated set
    methods = {n for n, _ in inspect.getmembers(_api_class(class_name), inspect.isfunction) if not n.startswith("_")}
    assert names <= methods
    for tool in tools:
        assert "This tool belongs to" not in tool.description and tool.description
        assert tool.parameters["type"] == "object" and "required" in tool.parameters
        assert _schema_types(tool.parameters) <= JSON_TYPES
        assert tool.response is None or tool.response["type"] == "object"
        assert tool.env_class == class_name


def test_excluded_functions_are_hidden_and_refused() -> None:
    task = load_task("bfcl:multi_turn_base_0")
    env = make_env(task)
    names = {t.name for t in env.tools()}
    assert "cp" not in names and "mv" in names and "post_tweet" in names
    result = env.call("cp", {"source": "a", "destination": "b"})
    assert result.error and "unknown tool" in result.output["error"]


def test_missed_functions_appear_at_their_turn() -> None:
    task = load_task("bfcl:multi_turn_miss_func_3")
    assert task.extra["missed_function"] == {"1": ["find", "ls"]} and task.turns[1] == []
    env = make_env(task)
    before = {t.name for t in env.tools()}
    assert not {"find", "ls"} & before and "cd" in before and "mv" not in before
    assert env.call("find", {"path": "."}).error
    env.set_turn(1)
    assert {"find", "ls"} <= {t.name for t in env.tools()}
    assert not env.call("find", {"path": "."}).error
    assert {t.name for t in env.available_tools(0)} == before


# -- the call boundary --------------------------------------------------------------

def test_read_only_tools_never_change_anything() -> None:
    """Every gold call of a read-only tool leaves its instance byte-identical (private state too)."""
    checked = 0
    for task_id in list_tasks():
        task = load_task(task_id)
        env = BFCLEnvironment.from_task(task, all_tools=True)
        for turn, calls in enumerate(task.ground_truth):
            env.set_turn(turn)
            for call in calls:
                name, args = parse_call_string(call, env.param_names)
                tool = env.get_tool(name)
                instance = env.instances[tool.env_class]
                before = pickle.dumps(instance) if tool.read_only else None
                env.call(name, args)
                if tool.read_only:
                    checked += 1
                    assert pickle.dumps(instance) == before, f"{name} changed state in {task_id}"
    assert checked > 1000


def _error_cases() -> list[tuple[str, dict]]:
    return [
        ("no_such_tool", {}),
        ("mkdir", {"dir_name": 42}),  # wrong type
        ("mv", {"source": "final_report.pdf"}),  # missing argument
        ("mkdir", {"dir_name": "x", "mode": "0755"}),  # unexpected argument
        ("ls", {"a": "yes"}),
        ("mkdir", ["not", "a", "dict"]),
        ("cp", {"source": "a", "destination": "b"}),  # excluded in this task
    ]


@pytest.mark.parametrize("name,args", _error_cases())
def test_bad_calls_are_error_results_and_change_nothing(name: str, args: dict) -> None:
    env = make_env(load_task("bfcl:multi_turn_base_0"))
    before = env.state()
    result = env.call(name, args)
    assert result.error and isinstance(result.output["error"], str)
    json.dumps(result.output)
    assert env.state() == before


def test_tool_that_raises_is_an_error_result() -> None:
    env = BFCLEnvironment(["TradingBot", "MathAPI"], {})
    assert not env.call("trading_login", {"username": "u", "password": "p"}).error
    before = env.state()
    result = env.call("get_transaction_history", {"start_date": "not a date"})
    assert result.error and result.output["error"].startswith("ValueError:")
    overflow = env.call("power", {"base": 10, "exponent": 1e6})
    assert overflow.error and "OverflowError" in overflow.output["error"]
    assert env.state() == before


def test_error_key_in_result_sets_error_flag_and_null_optional_is_absent() -> None:
    env = make_env(load_task("bfcl:multi_turn_base_0"))
    assert env.call("cat", {"file_name": "missing.txt"}).error
    listing = env.call("ls", {"a": None})
    assert not listing.error and listing.output == env.call("ls", {}).output


def test_results_and_state_are_json_and_detached() -> None:
    for task_id in ["bfcl:multi_turn_base_0", "bfcl:multi_turn_base_100", "bfcl:multi_turn_long_context_150",
                    "bfcl:multi_turn_base_50", "bfcl:multi_turn_miss_param_175"]:
        task = load_task(task_id)
        env = make_env(task)
        json.dumps(env.state(), allow_nan=False)
        for turn, calls in enumerate(task.ground_truth):
            env.set_turn(turn)
            for _, _, result in _run_gold(env, calls):
                json.dumps(result.output, allow_nan=False)
        json.dumps(env.state(), allow_nan=False)
    # A result is a snapshot: later calls do not rewrite it.
    env = BFCLEnvironment(["TradingBot"], {})
    env.call("trading_login", {"username": "u", "password": "p"})
    watch = env.call("get_watchlist", {}).output
    env.call("add_to_watchlist", {"stock": "AAPL"})
    assert "AAPL" in env.call("get_watchlist", {}).output["watchlist"]
    assert "AAPL" not in watch["watchlist"]


def test_fork_is_independent() -> None:
    env = make_env(load_task("bfcl:multi_turn_base_0"))
    before = env.state()
    fork = env.fork()
    assert isinstance(fork, Environment)
    assert not fork.call("mkdir", {"dir_name": "only_on_fork"}).error
    assert env.state() == before and fork.state() != before
    assert "only_on_fork" in fork.call("ls", {}).output["current_directory_content"]
    assert "only_on_fork" not in env.call("ls", {}).output["current_directory_content"]


def test_the_state_says_where_the_file_system_is_so_cd_is_a_change_of_state() -> None:
    env = make_env(load_task("bfcl:multi_turn_base_0"))
    start = env.state()["GorillaFileSystem"]["current_working_directory"]
    assert start == env.call("pwd", {}).output["current_working_directory"]
    listing = env.call("ls", {}).output["current_directory_content"]
    folder = next(name for name in listing if not env.fork().call("cd", {"folder": name}).error)
    before = env.state()
    assert not env.call("cd", {"folder": folder}).error
    after = env.state()["GorillaFileSystem"]["current_working_directory"]
    assert after == f"{start.rstrip('/')}/{folder}" and env.state() != before
    assert env.call("cd", {"folder": "no_such_folder"}).error
    assert env.state()["GorillaFileSystem"]["current_working_directory"] == after


# -- ground truth and the judge -----------------------------------------------------

def test_replay_all_base_tasks_passes() -> None:
    failures = {}
    for task_id in list_tasks("multi_turn_base"):
        checks = replay_ground_truth(load_task(task_id))
        if not all(c.success for c in checks):
            failures[task_id] = [c.details.get("error_type") for c in checks]
    assert not failures


@pytest.mark.parametrize("category", ["multi_turn_miss_param", "multi_turn_long_context", "multi_turn_miss_func"])
def test_replay_other_categories(category: str) -> None:
    failing = [t for t in list_tasks(category) if not all(c.success for c in replay_ground_truth(load_task(t)))]
    # miss_func_49's gold uses `tail` two turns before the turn that reveals it.
    assert failing == (["bfcl:multi_turn_miss_func_49"] if category == "multi_turn_miss_func" else [])


def test_extra_write_fails_the_state_check() -> None:
    task = load_task("bfcl:multi_turn_base_0")
    env, judge = make_env(task), make_judge(task)
    assert isinstance(judge, BFCLJudge)
    executed = _run_gold(env, task.ground_truth[0])
    executed.append(("mkdir", {"dir_name": "stray"}, env.call("mkdir", {"dir_name": "stray"})))
    check = judge.check_turn(0, env, executed)
    assert not check.success and not check.state_ok and check.response_ok
    assert check.details["error_type"] == "multi_turn:instance_state_mismatch"
    assert "GorillaFileSystem" in check.details["state_differences"]
    json.dumps(check.details)


def test_missing_read_fails_the_response_check() -> None:
    task = load_task("bfcl:multi_turn_base_0")
    env, judge = make_env(task), BFCLJudge(task)
    assert judge.check_turn(0, env, _run_gold(env, task.ground_truth[0])).success
    env.set_turn(1)
    # Turn 1's gold is cd + grep; doing only the cd leaves the state right but the answer missing.
    check = judge.check_turn(1, env, _run_gold(env, ["cd(folder='temp')"]))
    assert check.state_ok and not check.response_ok and not check.success
    assert check.details["error_type"] == "multi_turn:execution_response_mismatch"
    assert "matching_lines" in check.details["missing_results"][0]


def test_judge_turn_order_and_empty_turns() -> None:
    task = load_task("bfcl:multi_turn_miss_func_3")
    assert task.ground_truth[0] == []
    env, judge = make_env(task), BFCLJudge(task)
    with pytest.raises(ValueError):
        judge.check_turn(1, env, [])
    acting = judge.check_turn(0, env, [("cd", {"folder": "x"}, env.call("cd", {"folder": "x"}))])
    assert not acting.success and acting.details["error_type"] == "multi_turn:irrelevance_error"
    env, judge = make_env(task), BFCLJudge(task)
    assert judge.check_turn(0, env, []).success
    env.set_turn(1)
    assert not judge.check_turn(1, env, []).success  # gold calls, but the model did nothing


# -- parsing ground truth -----------------------------------------------------------

@pytest.mark.parametrize(
    "call,expected",
    [
        ("mv(source='a', destination='b')", ("mv", {"source": "a", "destination": "b"})),
        ("ls()", ("ls", {})),
        ("ls(a=True)", ("ls", {"a": True})),
        ("add(a=-3, b=-0.5)", ("add", {"a": -3, "b": -0.5})),
        ("echo(content='a, b (c), d=e', file_name='x.txt')", ("echo", {"content": "a, b (c), d=e", "file_name": "x.txt"})),
        ("post_tweet(content=\"it's\", tags=['#a', '#b'], mentions=[])", ("post_tweet", {"content": "it's", "tags": ["#a", "#b"], "mentions": []})),
        ("edit_ticket(ticket_id=1, updates={'status': 'open', 'priority': 3, 'n': [1, (2, 3)]})",
         ("edit_ticket", {"ticket_id": 1, "updates": {"status": "open", "priority": 3, "n": [1, [2, 3]]}})),
        ("mean(numbers=[[1, -2], [3.5e2]])", ("mean", {"numbers": [[1, -2], [350.0]]})),
        ("  f(x=None)  ", ("f", {"x": None})),
    ],
)
def test_parse_call_string(call: str, expected: tuple) -> None:
    assert parse_call_string(call) == expected


def test_parse_positional_arguments() -> None:
    env = make_env(load_task("bfcl:multi_turn_base_50"))
    assert parse_call_string("get_zipcode_based_on_city('Rivermist')", env.param_names) == (
        "get_zipcode_based_on_city", {"city": "Rivermist"})
    assert parse_call_string("f(1, y=2)", lambda name: ["x", "y"]) == ("f", {"x": 1, "y": 2})


@pytest.mark.parametrize(
    "call", ["mv(source=open('x'))", "__import__('os').system('x')", "a.b(x=1)", "mv(**d)", "mv(", "x = 1", "f(1)"]
)
def test_parse_call_string_rejects(call: str) -> None:
    with pytest.raises(ValueError):
        parse_call_string(call)
