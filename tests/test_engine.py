"""Engine control flow with a scripted policy (canned text) on the mock key-value environment."""
import json

import pytest

from app import envs
from app.engine import EpisodeRunner, episode_json
from app.engine.history import turn_messages
from app.engine.planner import StepPlanner, step_seed
from app.engine.runner import NOT_EXECUTED_CANNOT_FORK, NOT_EXECUTED_SHADOW_OFF
from app.envs.base import Tool
from app.formats import HistoryItem, call_text
from app.records import Call, RunSettings
from app.store import Recorder, Store
from model_backend.base import Generation
from scripted import AheadPolicy, ScriptedPolicy


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def runner(actions, settings=None, **policy_kwargs):
    task = envs.load_task("mock:kv")
    policy = ScriptedPolicy(actions, **policy_kwargs)
    return EpisodeRunner(task, policy, settings or RunSettings(mode="parallel", branches=3)), policy


def test_parallel_step_rehearses_all_branches_and_commits_one():
    # Greedy: set; alternatives: a read (shadowed) and a duplicate of the greedy call.
    r, policy = runner([[call("set", key="color", value="blue"), call("list_keys"),
                         call("set", key="color", value="blue")]],
                       predict=lambda text: {"ok": True} if '"set"' in text else {"keys": ["size"]},
                       judge=lambda text: 0.9 if '"set"' in text else 0.2)
    before = r.env.state()
    step = r.step()
    assert [b.kind for b in step.branches] == ["call", "call"]
    assert step.branches[0].duplicates == 1            # canonical dedup
    assert len(policy.rehearse_calls) == 1 and len(policy.rehearse_calls[0]) == 2  # one batched pass
    chosen, other = step.branches[step.chosen], step.branches[1 - step.chosen]
    assert chosen.call.name == "set" and chosen.chosen and chosen.actual_source == "committed"
    assert chosen.actual == {"ok": True} and chosen.metrics.exact is True
    assert other.actual_source == "shadow" and other.actual == {"keys": ["size"]}
    assert other.metrics.exact is True and other.metrics.surprise is not None
    assert step.state_before == before and step.state_after["MockKV"]["store"]["color"] == "blue"
    assert (step.external_calls, step.shadow_calls, step.rehearsals) == (1, 1, 2)
    assert chosen.scores["judge"] == pytest.approx(0.9)


def test_writes_run_on_their_own_fork_and_never_touch_the_episode_env():
    r, _ = runner([[call("set", key="a", value=1), call("delete", key="size"), call("set", key="b", value=2),
                    call("get", key="size")]], settings=RunSettings(mode="parallel", branches=4),
                  judge=lambda text: 0.9 if '"a"' in text else 0.1)
    step = r.step()
    by_name = {(b.call.name, b.call.arguments.get("key")): b for b in step.branches}
    delete, write_b, get = by_name[("delete", "size")], by_name[("set", "b")], by_name[("get", "size")]
    assert delete.actual_source == "shadow" and delete.actual == {"deleted": "size"} and not delete.actual_error
    assert delete.shadow_state_after == {"MockKV": {"store": {}}}  # its own fork of the pre-step state
    assert write_b.shadow_state_after == {"MockKV": {"store": {"size": "L", "b": 2}}}  # not after `delete`
    assert get.actual == {"value": "L"} and get.shadow_state_after == step.state_before
    assert delete.metrics.json_valid is True and delete.not_executed is None
    chosen = step.chosen_branch
    assert chosen.call.arguments == {"key": "a", "value": 1} and chosen.shadow_state_after is None
    assert r.env.state()["MockKV"]["store"] == {"size": "L", "a": 1} == step.state_after["MockKV"]["store"]
    assert (step.external_calls, step.shadow_calls) == (1, 3)
    assert (r.episode.external_calls, r.episode.shadow_calls) == (1, 3)


def test_an_env_that_cannot_fork_shadows_read_only_calls_only():
    task = envs.load_task("mock:kv")
    env = envs.MockEnvironment(task.initial_config["MockKV"], forkable=False)
    policy = ScriptedPolicy([[call("set", key="a", value=1), call("delete", key="size"), call("get", key="size")]],
                            judge=lambda text: 0.9 if '"set"' in text else 0.1)
    r = EpisodeRunner(task, policy, RunSettings(mode="parallel", branches=3), env=env)
    step = r.step()
    by_name = {b.call.name: b for b in step.branches}
    assert by_name["delete"].actual_source is None and by_name["delete"].shadow_state_after is None
    assert by_name["delete"].not_executed == NOT_EXECUTED_CANNOT_FORK
    assert by_name["get"].actual_source == "shadow" and by_name["get"].actual == {"value": "L"}
    assert (step.external_calls, step.shadow_calls) == (1, 1)
    assert r.env.state()["MockKV"]["store"] == {"size": "L", "a": 1}


def test_shadow_off_says_so_on_every_non_chosen_call():
    r, _ = runner([[call("set", key="a", value=1), call("get", key="size")]],
                  settings=RunSettings(mode="parallel", branches=2, shadow=False),
                  judge=lambda text: 0.9 if '"set"' in text else 0.1)
    step = r.step()
    other = step.branches[1 - step.chosen]
    assert other.actual_source is None and other.not_executed == NOT_EXECUTED_SHADOW_OFF
    assert step.shadow_calls == 0


def test_predicted_error_is_penalised_and_judge_picks_best():
    r, _ = runner([[call("get", key="missing"), call("set", key="color", value="blue")]],
                  predict=lambda text: {"error": "no such key"} if '"get"' in text else {"ok": True},
                  judge=lambda text: 0.6)
    step = r.step()
    assert step.branches[step.chosen].call.name == "set"
    assert step.branches[0].scores["judge"] < step.branches[1].scores["judge"]


def test_bad_model_output_becomes_branches_and_episode_goes_on():
    r, _ = runner([["<tool_call>{broken", call("nope_tool", x=1), "<tool_call>{\"name\": \"list_keys\""],
                   ["Stored."]],
                  settings=RunSettings(mode="parallel", branches=3, selector="logprob"))
    s1 = r.step()
    assert [b.kind for b in s1.branches] == ["parse_error", "call", "parse_error"]
    assert "unclosed" in s1.branches[2].parse_error
    unknown = s1.branches[1]
    assert s1.chosen == 1 and unknown.actual_error is True and "unknown tool" in unknown.actual["error"]
    assert s1.branches[0].actual_source is None and s1.branches[0].scores["logprob"] < unknown.scores["logprob"]
    s2 = r.step()  # the episode goes on
    assert s2.kind == "answer" and r.turn == 1


def test_wrong_argument_types_and_tool_exceptions_are_error_results():
    r, _ = runner([[call("set", key=["x"], value=1)], [call("fail")], ["done"]],
                  settings=RunSettings(mode="none", branches=1))
    s1, s2 = r.step(), r.step()
    assert s1.branches[0].actual_error and "invalid arguments" in s1.branches[0].actual["error"]
    assert s2.branches[0].actual_error and "always fails" in s2.branches[0].actual["error"]
    assert s1.state_after == s1.state_before


def test_all_parse_errors_commit_an_error_the_agent_sees():
    r, policy = runner([["<tool_call>{bad"], ["The key is stored."]], settings=RunSettings(mode="none", branches=1))
    step = r.step()
    assert step.kind == "parse_error" and step.branches[0].actual_source == "committed"
    assert step.external_calls == 0
    r.step()
    last_prompt = policy.act_calls[-1][0]
    assert "could not parse" in last_prompt.messages[-1]["content"]


def test_full_episode_succeeds_against_the_replay_judge(tmp_path):
    actions = [[call("set", key="color", value="blue")], ["Done."],
               [call("delete", key="size")], [call("get", key="color")], ["It is blue."]]
    r, _ = runner(actions, settings=RunSettings(mode="none", branches=1))
    store = Store(tmp_path / "e.db")
    recorder = Recorder(store)
    r.on_step = recorder
    recorder.start(r.episode)
    steps = list(r.run())
    ep = r.episode
    assert ep.status == "finished" and ep.success is True
    assert [t.success for t in ep.turn_results] == [True, True]
    assert ep.external_calls == 3 == sum(1 for s in steps if s.kind == "call")
    assert store.get_episode(ep.id).model_dump() == ep.model_dump()
    out = episode_json(ep)
    assert {"episode_id", "task", "success", "steps", "external_calls", "shadow_calls", "rehearsals"} <= set(out)
    assert {"call", "predicted", "actual", "actual_source", "chosen", "metrics"} <= set(out["steps"][0]["branches"][0])


def test_wrong_action_fails_the_turn():
    r, _ = runner([[call("set", key="color", value="red")], ["Done."],
                   [call("delete", key="size")], ["ok"]], settings=RunSettings(mode="none", branches=1))
    r.run_all()
    assert r.episode.turn_results[0].success is False and r.episode.success is False


def test_step_budget_ends_the_turn():
    r, _ = runner([[call("list_keys")]] * 10, settings=RunSettings(mode="none", branches=1, max_steps_per_turn=2))
    steps = list(r.run_turn())
    assert len(steps) == 2 and r.turn == 1 and len(r.episode.turn_results) == 1


def test_sequential_retries_while_rehearsal_predicts_failure():
    r, policy = runner([[call("get", key="missing")], [call("get", key="size"), call("get", key="size")]],
                       predict=lambda text: {"error": "no such key"} if "missing" in text.split("Call:")[-1] else {"value": "L"},
                       judge=lambda text: 0.9, settings=RunSettings(mode="sequential", branches=3))
    step = r.step()
    assert len(step.branches) == 2 and step.chosen == 1
    assert step.branches[1].actual == {"value": "L"} and step.rehearsals == 2
    second_prompt = policy.act_calls[1][0]
    assert "Private rehearsal" in second_prompt.messages[-1]["content"]


def test_memory_selector_lets_the_policy_write_the_committed_call():
    r, policy = runner([[call("get", key="missing"), call("list_keys")], [call("list_keys")]],
                       settings=RunSettings(mode="parallel", branches=2, selector="memory", keep_primary=False))
    step = r.step()
    assert step.branches[step.chosen].call.name == "list_keys"
    assert step.branches[step.chosen].scores["memory"] == 1.0
    assert "Private rehearsal" in policy.act_calls[1][0].messages[-1]["content"]


def test_state_snapshot_reaches_the_rehearse_prompt():
    r, policy = runner([[call("get", key="size")]],
                       settings=RunSettings(mode="parallel", branches=1, rehearsal_context="history+state"))
    r.step()
    assert "Environment state" in policy.rehearse_calls[0][0].messages[-1]["content"]


def test_history_and_state_shows_a_rehearsal_the_state_of_its_tools_class_before_the_call():
    """Under history+state, on BFCL the Rehearse prompt shows the calling class's state as it was before the step
    (the file `ls` will list), and no other class's (the default, since the shipped adapter was trained on it);
    `history` shows none."""
    task = envs.load_task("bfcl:multi_turn_base_0")
    assert RunSettings().rehearsal_context == "history+state"
    plain = ScriptedPolicy([[call("ls")]])
    EpisodeRunner(task, plain, RunSettings(mode="parallel", branches=1, shadow=False,
                                           rehearsal_context="history")).step()
    assert "Environment state" not in plain.rehearse_calls[0][0].messages[-1]["content"]
    policy = ScriptedPolicy([[call("ls")], [call("mkdir", dir_name="newdir")], [call("ls")]])
    r = EpisodeRunner(task, policy, RunSettings(mode="parallel", branches=1, shadow=False,
                                                rehearsal_context="history+state"))
    for _ in range(3):
        r.step()
    prompts = [batch[0].messages[-1]["content"] for batch in policy.rehearse_calls]
    assert all("Environment state (GorillaFileSystem):" in p for p in prompts)
    assert all("TwitterAPI" not in p.split("Tool:")[0] for p in prompts)
    states = [p.split("Environment state (GorillaFileSystem):")[1].split("Tool:")[0] for p in prompts]
    assert '"newdir"' not in states[1] and '"newdir"' in states[2]  # the state before each call

def test_tool_choice_required_prefills_the_call_tag():
    r, policy = runner([['{"name": "list_keys", "arguments": {}}</tool_call>']],
                       settings=RunSettings(mode="none", branches=1, tool_choice="required"))
    step = r.step()
    assert policy.act_calls[0][0].prefill == "<tool_call>" and step.kind == "call"


def test_tool_choice_first_prefills_only_the_first_step_of_each_turn():
    r, policy = runner([['{"name": "list_keys", "arguments": {}}</tool_call>'], ["Done."],
                        ['{"name": "get", "arguments": {"key": "size"}}</tool_call>']],
                       settings=RunSettings(mode="none", branches=1, tool_choice="first"))
    steps = [r.step() for _ in range(3)]
    assert [p[0].prefill for p in policy.act_calls] == ["<tool_call>", "", "<tool_call>"]
    assert [(s.turn, s.kind) for s in steps] == [(0, "call"), (0, "answer"), (1, "call")]


RANKS = {"get": -0.1, "list_keys": -0.2, "set": -0.3, "delete": -2.0, "fail": -3.0}


def test_tools_proposal_calls_the_next_ranked_tools():
    """`proposal=tools`: the greedy action, then one call to each of the K-1 best-ranked other tools, each
    prompt opened on its tool (constrained to its schema), ranked by the tool name's log-probability."""
    r, policy = runner([[call("list_keys")]], settings=RunSettings(mode="parallel", branches=3, proposal="tools"),
                       name_scores=RANKS, arguments={"get": {"key": "size"}, "set": {"key": "a", "value": 1}})
    step = r.step()
    assert [b.call.name for b in step.branches] == ["list_keys", "get", "set"]
    assert policy.act_calls[0][1] == 1  # the greedy action alone; the others are forced, not sampled
    forced = policy.act_each_calls[0]
    assert [p.prefill for p in forced] == ["<tool_call>", "<tool_call>"]
    assert [p.constraint.schema["properties"]["name"]["const"] for p in forced] == ["get", "set"]
    assert not step.branches[0].sampled and all(b.sampled for b in step.branches[1:])
    assert step.branches[1].actual == {"value": "L"}  # shadow-executed on its fork like any alternative
    assert r.env.state()["MockKV"]["store"].get("a") is None  # the set ran on its fork only


def test_tools_proposal_after_a_plain_answer_and_unconstrained():
    """When the greedy action answers in text, the alternatives are the K-1 best tools; without a constraint
    the tool's name is written into the prefill, and its log-probabilities lead the alternative's."""
    r, policy = runner([["All done."]], settings=RunSettings(mode="parallel", branches=3, proposal="tools",
                                                             constrain=False, selector="logprob"),
                       name_scores=RANKS, arguments={"get": {"key": "size"}})
    step = r.step()
    assert [b.kind for b in step.branches] == ["answer", "call", "call"]
    assert [b.call.name for b in step.branches[1:]] == ["get", "list_keys"]
    forced = policy.act_each_calls[0]
    assert forced[0].prefill == '<tool_call>{"name": "get", "arguments": ' and forced[0].constraint is None
    # -0.1 for the name, then four generated tokens at -0.3: the mean covers the whole call
    assert step.branches[1].act_logprob == pytest.approx((-0.1 - 4 * 0.3) / 5)


def test_tools_proposal_with_one_candidate_or_one_tool_is_the_greedy_action():
    r, policy = runner([[call("get", key="size")]], settings=RunSettings(mode="parallel", branches=1,
                                                                        proposal="tools"), name_scores=RANKS)
    step = r.step()
    assert len(step.branches) == 1 and policy.act_each_calls == []


def test_stored_settings_without_a_proposal_sampled():
    old = RunSettings().model_dump()
    del old["proposal"]
    assert RunSettings.from_stored(old).proposal == "sample"
    assert RunSettings.from_stored(RunSettings(proposal="tools").model_dump()).proposal == "tools"


def test_same_seed_same_episode():
    def run_once():
        r, _ = runner([[call("set", key="color", value="blue"), call("list_keys")], ["Done."],
                       [call("delete", key="size")], ["ok"]])
        steps = episode_json(r.run_all())["steps"]
        return [{k: v for k, v in s.items() if k != "duration_s"} for s in steps]
    assert run_once() == run_once()


# ---------------------------------------------------------------- strategy tables


def test_the_tables_name_exactly_the_settings_the_product_offers():
    from app.engine import strategies
    from app.records import MODES, SELECTORS
    assert set(strategies.MODE_TABLE) == set(MODES)
    assert set(strategies.SELECTOR_TABLE) == set(SELECTORS) | {"oracle"}  # oracle: evaluation only
    assert all(name == s.name for name, s in strategies.SELECTOR_TABLE.items())


def test_a_rehearser_passed_in_replaces_the_models_prediction():
    # A fork-executing rehearser under the logprob selector: every candidate runs on its own fork
    # (counted as the agent's external calls), nothing is predicted, the episode state sees only the commit.
    from app.engine.rehearsers import ForkRehearser
    task = envs.load_task("mock:kv")
    policy = ScriptedPolicy([[call("set", key="a", value=1), call("delete", key="size"), call("get", key="size")]])
    r = EpisodeRunner(task, policy, RunSettings(mode="parallel", branches=3, selector="logprob", shadow=False),
                      rehearser=ForkRehearser())
    step = r.step()
    assert policy.rehearse_calls == []
    assert step.chosen == 0 and step.chosen_branch.actual_source == "committed"
    assert step.chosen_branch.shadow_state_after is None  # committed: state_after shows it
    delete = step.branches[1]
    assert delete.actual_source == "shadow" and delete.shadow_state_after == {"MockKV": {"store": {}}}
    assert (step.external_calls, step.shadow_calls, step.rehearsals) == (3, 0, 0)
    assert r.env.state()["MockKV"]["store"] == {"size": "L", "a": 1}


def test_step_scratch_state_does_not_outlive_the_step():
    r, _ = runner([[call("set", key="a", value=1), call("get", key="size")], ["Done."]])
    before, planner_before = set(vars(r)), set(vars(r.planner))
    r.step()
    r.step()
    assert set(vars(r)) == before  # prompts, forks and the dedup table live in the step's context
    assert set(vars(r.planner)) == planner_before  # the planner's too


# ---------------------------------------------------------------- the step planner on its own


class SeedPolicy(ScriptedPolicy):
    """Records the generation config of each Act call (the seed a step's candidates are drawn with)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.act_configs = []

    def act(self, prompt, k, config):
        self.act_configs.append(config)
        return super().act(prompt, k, config)


KV_TOOLS = [Tool(name="get", description="Read a key.", read_only=True,
                 parameters={"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),
            Tool(name="list_keys", description="List the keys.", read_only=True,
                 parameters={"type": "object", "properties": {}})]


def test_a_step_planner_plans_a_step_with_no_task_environment_or_judge():
    """What the world model and the offline rehearsal use: a `StepPlanner` given tools and a conversation proposes
    K candidates (duplicates folded), rehearses every call in one batched pass and picks one, with no Task,
    Environment or judge anywhere and nothing executed; the seed is the step's (`step_seed`)."""
    policy = SeedPolicy([[call("get", key="color"), call("list_keys"), call("get", key="color")]],
                        predict=lambda text: {"error": "no such key"} if '"get"' in text else {"keys": ["size"]})
    settings = RunSettings(mode="parallel", branches=3, selector="logprob", seed=5)
    planner = StepPlanner(policy, settings)
    earlier = Call(name="list_keys", arguments={})
    history = [HistoryItem(role="user", content="What colour did I store?"),
               HistoryItem(role="assistant", content=call_text(earlier), call=earlier),
               HistoryItem(role="tool", content="", result={"keys": ["sky_colour"]})]
    ctx = planner.context(4, KV_TOOLS, history)
    chosen = planner.plan(ctx)
    assert ctx.episode is None and ctx.history is history
    get, keys = ctx.branches
    assert (get.call.name, keys.call.name, get.duplicates) == ("get", "list_keys", 1)
    assert [len(batch) for batch in policy.rehearse_calls] == [2] and ctx.rehearsals == 2
    assert get.predicted == {"error": "no such key"} and keys.predicted == {"keys": ["size"]}
    assert chosen == 1 and keys.scores["logprob"] > get.scores["logprob"]  # the foreseen error moved the choice
    assert get.actual_source is None and keys.actual_source is None  # nothing ran
    [(prompt, k)] = policy.act_calls
    assert k == 3 and "What colour did I store?" in json.dumps(prompt.messages)
    assert policy.act_configs[0].seed == step_seed(5, 4)
    assert "sky_colour" in json.dumps(policy.rehearse_calls[0][0].messages)  # the conversation's real result


def test_an_episodes_step_is_its_planners_plan_on_the_same_conversation():
    """The runner plans through its planner: planning the step on the runner's conversation and tools alone gives
    the same Act and Rehearse prompts and the same branches the runner's step got."""
    actions = [[call("set", key="color", value="blue"), call("list_keys"), call("delete", key="size")]]
    r, in_episode = runner([list(a) for a in actions])
    step = r.step()
    alone = ScriptedPolicy([list(a) for a in actions])
    planner = StepPlanner(alone, r.settings)
    ctx = planner.context(step.index, r.env.tools(), turn_messages(r.task, 0), step.state_before)
    chosen = planner.plan(ctx)
    assert alone.act_calls == in_episode.act_calls and alone.rehearse_calls == in_episode.rehearse_calls
    assert chosen == step.chosen
    assert [(b.action_text, b.predicted, b.scores) for b in ctx.branches] == [
        (b.action_text, b.predicted, b.scores) for b in step.branches]


def test_the_real_best_of_k_needs_an_episode():
    """The fork rehearser and the outcome selector read the episode (its environment, judge and task): planned
    outside one, a step is refused with a message that says so, before anything is proposed twice."""
    from app.engine.context import StepContext
    from app.engine.oracle import OutcomeSelector, oracle_settings
    planner = StepPlanner(ScriptedPolicy([[call("get", key="a"), call("list_keys")]]),
                          oracle_settings(RunSettings(branches=2)))
    with pytest.raises(ValueError, match=r"^the fork rehearser \(real best-of-K\) needs an episode"):
        planner.plan(planner.context(0, KV_TOOLS, [HistoryItem(role="user", content="hi")]))
    ctx = StepContext(planner=planner, index=0, tools_list=KV_TOOLS, state_before={}, history=[])
    answer = planner.parse_branches(ctx, [Generation(text="Hello.", token_logprobs=[-0.1])])
    with pytest.raises(ValueError, match=r"^the outcome selector \(oracle\) needs an episode"):
        OutcomeSelector().score(ctx, answer)


def test_relevance_re_aims_the_primary_at_the_best_ranked_tool():
    """`relevance` > 0: tools rank by direct + weight * log P(request | tool); the greedy action's call is
    replaced by a greedy call to the top tool, which carries its log-probability under the ranking. The
    channel pass runs once per turn (same request, same tools)."""
    r, policy = runner([[call("list_keys")], [call("list_keys")]],
                       settings=RunSettings(mode="none", branches=1, relevance=1.0), name_scores=RANKS,
                       relevance={"set": 0.0}, arguments={"set": {"key": "a", "value": 1}})
    first, second = r.step(), r.step()
    assert [b.call.name for b in first.branches] == ["set"]
    assert not first.branches[0].sampled  # the primary, re-aimed: not an alternative
    assert r.env.state()["MockKV"]["store"]["a"] == 1  # committed for real
    assert first.branches[0].scores["tool"] == 0.0  # relative to the top tool: the top tool itself
    assert second.turn == first.turn and policy.relevance_calls == 1


def test_relevance_top_scores_the_direct_scores_first_tools_only():
    """`relevance_top` N: the channel scores the request under the N tools the direct score ranks first; a tool
    outside them ranks below them whatever its relevance would have been. `delete` (direct -2.0, 4th) would win on
    relevance, but with N=2 only `get` and `list_keys` are scored, and `list_keys` wins; N=0 scores every tool."""
    def primary(top):
        r, _ = runner([[call("get", key="size")]],
                      settings=RunSettings(mode="none", branches=1, relevance=1.0, relevance_top=top),
                      name_scores=RANKS, relevance={"delete": 10.0, "list_keys": 0.0},
                      arguments={"delete": {"key": "size"}})
        step = r.step()
        return step.branches[0].call.name, r.planner.relevance_cache

    name, asked = primary(2)
    assert name == "list_keys" and sorted(k[1] for k in asked) == ["get", "list_keys"]
    name, asked = primary(0)
    assert name == "delete" and sorted(k[1] for k in asked) == sorted(RANKS)
    assert RunSettings.from_stored({}).relevance_top == 0  # stored before the field: every tool was scored


def test_relevance_leaves_a_plain_answer_alone():
    r, policy = runner([["All done."]], settings=RunSettings(mode="none", branches=1, relevance=1.0),
                       name_scores=RANKS, relevance={"set": 0.0})
    step = r.step()
    assert step.kind == "answer" and policy.act_each_calls == [] and "tool" not in step.branches[0].scores


def test_relevance_ranking_lets_a_foreseen_error_move_the_commit_to_the_next_tool():
    """Parallel, `tools`, logprob: the selector adds each call's tool log-probability. Near a tie, a
    rehearsal that predicts an error for the top tool commits the runner-up; without it, the top tool.
    Scores: set -0.1 (act) + log p(set); get -0.3 (act) + log p(get), 0.1 lower: 0.3 apart, under the 0.5 penalty."""
    def run(predict):
        r, _ = runner([[call("set", key="a", value=1)]],
                      settings=RunSettings(mode="parallel", branches=2, proposal="tools", selector="logprob",
                                           relevance=1.0),
                      name_scores=RANKS, relevance={"set": 0.0, "get": -0.3}, arguments={"get": {"key": "size"}},
                      predict=predict)
        step = r.step()
        return [b.call.name for b in step.branches], step.chosen_branch.call.name

    assert run(lambda text: {"ok": True}) == (["set", "get"], "set")
    assert run(lambda text: {"error": "no such key"} if '"set"' in text else {"value": "L"}) == (["set", "get"], "get")


def test_stored_settings_without_relevance_ranked_no_tools():
    old = RunSettings(relevance=0.5).model_dump()
    del old["relevance"]
    assert RunSettings.from_stored(old).relevance == 0.0


def test_relevance_is_off_for_a_policy_that_cannot_score():
    """A server without prompt log-probabilities cannot rank tools: the episode runs with the greedy
    action's tool, and its stored settings say relevance 0."""
    class NoScores(ScriptedPolicy):
        supports_scoring = False

        def score(self, prompts, continuations):
            raise AssertionError("score must not be called")

    task = envs.load_task("mock:kv")
    policy = NoScores([[call("list_keys")]], relevance={"set": 0.0})
    r = EpisodeRunner(task, policy, RunSettings(mode="none", branches=1, relevance=0.5))
    step = r.step()
    assert step.chosen_branch.call.name == "list_keys" and r.episode.settings.relevance == 0.0


def test_the_ui_wrapper_forwards_every_declared_capability():
    """`ProgressPolicy` answers each `Policy` capability as the policy it wraps does, not with the protocol's
    default: a server without prompt log-probabilities stays one through it, and the runner turns relevance off."""
    import contextlib

    from app.service.session import ProgressPolicy
    from model_backend import CAPABILITIES

    entered, resets = [], []

    class Capable(ScriptedPolicy):
        supports_scoring = False
        can_compute_ahead = True

        @contextlib.contextmanager
        def computing_ahead(self, stop=lambda: False):
            entered.append(stop())
            yield

        def reset_cache(self):
            resets.append(True)

    backend = Capable([[call("list_keys")]])
    wrapper = ProgressPolicy(backend)
    assert all(name in vars(ProgressPolicy) for name in CAPABILITIES)  # none left to the protocol's default
    assert wrapper.inner is backend and ProgressPolicy(wrapper).inner is backend
    assert wrapper.supports_scoring is False and wrapper.can_compute_ahead is True
    with wrapper.computing_ahead(lambda: True):
        pass
    wrapper.reset_cache()
    assert entered == [True] and resets == [True]
    r = EpisodeRunner(envs.load_task("mock:kv"), wrapper, RunSettings(mode="none", branches=1, relevance=0.5))
    assert r.settings.relevance == 0.0


def test_relevance_with_tool_candidates_re_aims_and_forces_in_one_batch():
    """`tools` + relevance: the re-aimed primary and the K-1 next tools are decoded in one `act_each` batch."""
    r, policy = runner([[call("list_keys")]],
                       settings=RunSettings(mode="parallel", branches=3, proposal="tools", selector="logprob",
                                            relevance=1.0),
                       name_scores=RANKS, relevance={"set": 0.0, "get": -0.5, "list_keys": -1.0},
                       arguments={"set": {"key": "a", "value": 1}, "get": {"key": "size"}})
    step = r.step()
    assert [b.call.name for b in step.branches] == ["set", "get", "list_keys"]
    assert [b.sampled for b in step.branches] == [False, True, True]
    assert len(policy.act_each_calls) == 1 and len(policy.act_each_calls[0]) == 3


def test_with_tools_ranked_the_primary_stands_unless_its_rehearsal_foresees_an_error():
    """logprob + relevance: a sampled plain answer with a higher mean log-probability does not displace the
    re-aimed primary call; a foreseen error on the primary does."""
    def run(predict):
        r, _ = runner([[call("list_keys"), "All done."]],
                      settings=RunSettings(mode="parallel", branches=2, selector="logprob", relevance=1.0),
                      name_scores=RANKS, relevance={"set": 0.0}, arguments={"set": {"key": "a", "value": 1}},
                      predict=predict)
        step = r.step()
        assert [b.kind for b in step.branches] == ["call", "answer"]
        assert step.branches[1].act_logprob > step.branches[0].act_logprob  # -0.2 against the forced call's -0.3
        return step.chosen_branch.kind

    assert run(lambda text: {"ok": True}) == "call"
    assert run(lambda text: {"error": "no such key"}) == "answer"


@pytest.mark.parametrize("primary_error, keep, committed", [
    (False, True, "get"),        # the judge prefers the alternative, but no evidence against the primary
    (False, False, "list_keys"),  # without the rule the top score commits
    (True, True, "list_keys"),   # the primary's rehearsal foresees an error: the alternative commits
])
def test_keep_primary_moves_off_the_greedy_call_only_on_a_predicted_error(primary_error, keep, committed):
    predicted = {"error": "no such key"} if primary_error else {"value": "L"}
    r, _ = runner([[call("get", key="size"), call("list_keys")]],
                  settings=RunSettings(mode="parallel", branches=2, keep_primary=keep),
                  predict=lambda text: predicted if '"get"' in text.split("Call:")[-1] else {"keys": ["size"]},
                  judge=lambda text: 0.9 if "list_keys" in text.split("Call:")[-1] else 0.89)
    step = r.step()
    assert step.chosen_branch.call.name == committed
    assert step.branches[1].scores["judge"] > step.branches[0].scores["judge"]  # the judge did prefer list_keys


# ---------------------------------------------------------------- why an episode ended


def test_an_episode_that_ends_says_why():
    from app.engine import end_reason_text

    # Both turns end with the agent's answer.
    r, _ = runner([[call("set", key="color", value="blue")], ["Stored."], [call("delete", key="size")], ["Done."]],
                  settings=RunSettings(mode="none", branches=1))
    ep = r.run_all()
    assert [t.ended_by for t in ep.turn_results] == ["answer", "answer"]
    assert ep.end_reason == "answered"
    assert "all 2 user turns done: the agent answered the last one" in end_reason_text(ep)
    assert episode_json(ep)["end_reason"] == "answered"

    # The last turn's step budget runs out before an answer.
    r, _ = runner([[call("set", key="color", value="blue")], ["Stored."]] + [[call("list_keys")]] * 2,
                  settings=RunSettings(mode="none", branches=1, max_steps_per_turn=2))
    ep = r.run_all()
    assert [t.ended_by for t in ep.turn_results] == ["answer", "step_budget"]
    assert ep.end_reason == "step_budget"
    assert "the last one used its whole step budget (2 steps) without an answer" in end_reason_text(ep)

    # Stopped, and failed: each says so (and a failed one what failed).
    r, _ = runner([[call("list_keys")]], settings=RunSettings(mode="none", branches=1))
    r.step()
    r.stop()
    assert r.episode.end_reason == "stopped" and end_reason_text(r.episode).startswith("stopped after 1 step and 0")
    r, _ = runner([[call("list_keys")]], settings=RunSettings(mode="none", branches=1))
    r.step()
    r.fail("the model server went away")
    assert (r.episode.status, r.episode.end_reason) == ("failed", "failed")
    assert end_reason_text(r.episode) == "a step failed after 1 step: the model server went away"
    assert end_reason_text(runner([["x"]])[0].episode) == ""  # still running: nothing to say


def test_a_trace_recorded_before_end_reasons_tells_from_its_steps():
    from app.engine import end_reason_text

    r, _ = runner([[call("set", key="color", value="blue")], ["Stored."], [call("delete", key="size")], ["Done."]],
                  settings=RunSettings(mode="none", branches=1))
    old = r.run_all().model_copy(update={"end_reason": None})
    assert "the agent answered the last one" in end_reason_text(old)
    assert "interrupted after 4 steps" in end_reason_text(old.model_copy(update={"status": "interrupted"}))


def test_a_typed_turn_reopens_a_finished_episode_and_clears_its_end_reason():
    from app.service.catalog import UnjudgedJudge

    task = envs.load_task("mock:kv")
    r = EpisodeRunner(task, ScriptedPolicy([["Sure."], ["Fine."], ["Again."]]),
                      RunSettings(mode="none", branches=1), judge=UnjudgedJudge("x"))
    r.run_all()
    assert r.episode.end_reason == "answered"
    r.add_user_turn("And now?")
    assert r.episode.status == "running" and r.episode.end_reason is None
    r.run_all()
    assert r.episode.end_reason == "answered" and len(r.episode.turn_results) == 3


# ---------------------------------------------------------------- what a step computed ahead took


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def work(self) -> None:
        self.now += 2.5  # the model's work, ahead or at Step

    def perf_counter(self):
        return self.now


def test_a_step_computed_ahead_carries_what_its_compute_took(monkeypatch):
    from app.engine import compute_time
    from app.engine import runner as runner_module

    clock = FakeClock()
    monkeypatch.setattr(runner_module, "time", clock)
    task = envs.load_task("mock:kv")
    policy = AheadPolicy(clock.work, [[call("set", key="color", value="blue")], [call("list_keys")], ["Done."]])
    r = EpisodeRunner(task, policy, RunSettings(mode="none", branches=1))
    first = r.step()  # computed at Step
    assert (first.duration_s, first.ahead_s, first.compute_s) == (2.5, 0.0, 2.5)
    assert r.compute_ahead() is True
    second = r.step()  # only looked up: its model call ran ahead
    assert (second.duration_s, second.ahead_s, second.compute_s) == (0.0, 2.5, 2.5)
    assert compute_time(second) == "2.5 s (2.5 s computed ahead while the step before was read, 0.0 s at Step)"
    assert compute_time(first) == "2.5 s"
    assert r.step().ahead_s == 0.0  # nothing computed ahead for the third


def test_work_ahead_for_a_turn_the_person_then_retyped_is_not_counted(monkeypatch):
    from app.engine import runner as runner_module
    from app.service.catalog import UnjudgedJudge

    clock = FakeClock()
    monkeypatch.setattr(runner_module, "time", clock)
    task = envs.load_task("mock:kv")
    r = EpisodeRunner(task, AheadPolicy(clock.work, [["Sure."], ["Fine."]]), RunSettings(mode="none", branches=1),
                      judge=UnjudgedJudge("x"))
    r.step()  # turn 1 answered
    assert r.compute_ahead() is True  # turn 2 (the scripted one) computed ahead
    r.add_user_turn("Something else entirely.")
    step = r.step()
    assert step.ahead_s == 0.0 and step.duration_s == 2.5  # the work ahead was for another turn
