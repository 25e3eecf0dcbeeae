"""The rehearsal memory: real transitions in the store, retrieval by tool, the scope rules that keep measurement
honest, the runner remembering what it observes, and the Rehearse prompt carrying what was retrieved."""
from __future__ import annotations

import json

import pytest

from app import envs
from app.divergence import looping
from app.engine import EpisodeRunner, episode_json, format_step
from app.engine.memory import MemoryScope, RehearsalMemory, scenario_of
from app.formats import MEMORY_HEADER, rehearse_prompt
from app.records import Call, RunSettings, Transition
from app.store import Store
from model_backend.loops import open_string, repeated_phrase
from scripted import ScriptedPolicy


def t(tool: str, response, source: str = "expert", task_id: str = "bfcl:multi_turn_base_0", split: str = "train",
      episode_id: str | None = None, **arguments) -> Transition:
    return Transition(tool=tool, arguments=arguments, response=response, source=source, task_id=task_id,
                      split=split, episode_id=episode_id)


def test_store_keeps_transitions_across_reopen_and_dedups(tmp_path):
    db = tmp_path / "m.db"
    store = Store(db)
    added = store.add_transitions([t("cd", {"current_working_directory": "a"}, folder="a"),
                                   t("cd", {"current_working_directory": "a"}, folder="a"),
                                   t("ls", {"current_directory_content": []})])
    assert len(added) == 2 and all(x.id is not None for x in added)
    again = Store(db)
    held = again.transitions()
    assert [(x.tool, x.arguments) for x in held] == [("cd", {"folder": "a"}), ("ls", {})]
    assert again.transition_counts() == {"expert": 2}
    memory = RehearsalMemory.from_store(again)
    assert len(memory) == 2
    assert memory.add([t("cd", {"current_working_directory": "a"}, folder="a")]) == []  # held already
    memory.add([t("cd", {"error": "cd: no"}, source="committed", folder="zz")])
    assert len(Store(db).transitions()) == 3  # written through


def test_retrieve_same_tool_exact_match_first_then_similar_arguments():
    memory = RehearsalMemory(None, [
        t("cd", {"current_working_directory": "docs"}, folder="docs"),
        t("cd", {"current_working_directory": "photos"}, folder="photos"),
        t("mkdir", None, dir_name="photos"),
        t("cd", {"current_working_directory": "photos_2024"}, folder="photos 2024"),
    ])
    scope = MemoryScope("online")
    hits = memory.retrieve(Call(name="cd", arguments={"folder": "photos"}), scope, 3)
    assert [h.tool for h in hits] == ["cd", "cd", "cd"]
    assert hits[0].arguments == {"folder": "photos"} and hits[0].score >= 1e6
    assert hits[1].arguments == {"folder": "photos 2024"}  # shares the word "photos"
    assert memory.retrieve(Call(name="cd", arguments={"folder": "photos"}), scope, 1)[0].arguments == {"folder": "photos"}
    assert memory.retrieve(Call(name="rm", arguments={"file_name": "x"}), scope, 3) == []
    assert memory.retrieve(Call(name="cd", arguments={"folder": "x"}), MemoryScope("off"), 3) == []


def test_scope_never_shows_the_evaluated_tasks_own_transitions_but_its_episodes():
    task = "bfcl:multi_turn_base_3"
    memory = RehearsalMemory(None, [
        t("cd", {"current_working_directory": "a"}, task_id=task, split="heldout", folder="a"),      # ground truth
        t("cd", {"current_working_directory": "a"}, source="committed", task_id=task, split="heldout",
          episode_id="earlier", folder="a"),                                                        # another episode
        t("cd", {"current_working_directory": "a"}, source="committed", task_id=task, split="heldout",
          episode_id="this", folder="a"),                                                           # this episode
        t("cd", {"error": "no"}, source="explore", task_id="bfcl:multi_turn_base_0", folder="a"),  # training split
        t("cd", {"current_working_directory": "a"}, source="committed", task_id="bfcl:multi_turn_base_7",
          split="heldout", episode_id="other", folder="a"),                                         # online only
    ])
    call = Call(name="cd", arguments={"folder": "a"})
    seen = lambda scope: sorted((h.source, h.task_id) for h in memory.retrieve(call, scope, 8))  # noqa: E731
    seed_eval = MemoryScope("seed", task_id=task, episode_id="this", exclude_task=True)
    # Same (call, response) pairs fold into one hit: the episode's own observation, and the training split's error.
    assert seen(seed_eval) == [("committed", task), ("explore", "bfcl:multi_turn_base_0")]
    assert memory.retrieve(call, seed_eval, 1)[0].source == "committed"  # its own episode ranks first
    assert seen(MemoryScope("seed", task_id=task, episode_id="new", exclude_task=True)) == [
        ("explore", "bfcl:multi_turn_base_0")]
    # A sibling category's variant of the same scenario knows the answer too: it is excluded with the task.
    sibling = t("cd", {"current_working_directory": "a"}, source="committed", task_id="bfcl:multi_turn_miss_param_3",
                split="heldout", episode_id="sib", folder="a")
    assert memory.add([sibling]) and scenario_of("bfcl:multi_turn_miss_param_3") == scenario_of(task)
    assert scenario_of("bfcl:multi_turn_long_context_33") != scenario_of(task) and scenario_of("mock:kv") == "mock:kv"
    online_eval = MemoryScope("online", task_id=task, episode_id="new", exclude_task=True)
    assert {h.task_id for h in memory.retrieve(call, online_eval, 8)} == {"bfcl:multi_turn_base_0",
                                                                        "bfcl:multi_turn_base_7"}


def test_recent_transitions_rank_first_exact_then_newest():
    memory = RehearsalMemory(None, [t("cd", {"current_working_directory": "x"}, folder="x")])
    recent = [t("cd", {"current_working_directory": "a"}, source="committed", folder="a"),
              t("cd", {"current_working_directory": "b"}, source="committed", folder="b"),
              t("ls", {"current_directory_content": []}, source="committed")]
    hits = memory.retrieve(Call(name="cd", arguments={"folder": "a"}), MemoryScope("seed"), 3, recent)
    assert [h.arguments["folder"] for h in hits] == ["a", "b", "x"]


def test_rehearse_prompt_lists_memory_most_similar_last():
    memory = RehearsalMemory(None, [t("cd", {"current_working_directory": "photos"}, folder="photos"),
                                    t("cd", {"current_working_directory": "docs"}, folder="docs")])
    hits = memory.retrieve(Call(name="cd", arguments={"folder": "photos"}), MemoryScope("online"), 2)
    text = rehearse_prompt(None, Call(name="cd", arguments={"folder": "photos"}), [], examples=hits).messages[1]["content"]
    block = text.split(MEMORY_HEADER, 1)[1]
    assert block.index('"docs"') < block.index('"photos"}}</tool_call> -> {"current_working_directory": "photos"}')
    assert MEMORY_HEADER not in rehearse_prompt(None, Call(name="cd", arguments={}), []).messages[1]["content"]


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_runner_remembers_what_it_observes_and_the_next_rehearsal_sees_it(tmp_path):
    store = Store(tmp_path / "m.db")
    memory = RehearsalMemory.from_store(store)
    policy = ScriptedPolicy([[call("get", key="size")], [call("get", key="size")]],
                            predict=lambda text: {"value": "M"})
    runner = EpisodeRunner(envs.load_task("mock:kv"), policy, RunSettings(mode="parallel", branches=1, memory="online"),
                           memory=memory)
    first = runner.step()
    assert first.chosen_branch.memory == []
    held = store.transitions()
    assert [(x.tool, x.arguments, x.response, x.source, x.episode_id) for x in held] == [
        ("get", {"key": "size"}, {"value": "L"}, "committed", runner.episode.id)]
    second = runner.step()
    hit = second.chosen_branch.memory[0]
    assert (hit.arguments, hit.response, hit.source) == ({"key": "size"}, {"value": "L"}, "committed")
    assert '-> {"value": "L"}' in policy.rehearse_calls[-1][0].messages[1]["content"]
    # Provenance reaches the CLI's text and --json.
    assert 'memory (committed, mock:kv): {"key": "size"} -> {"value": "L"}' in format_step(second)
    assert episode_json(runner.episode)["steps"][1]["branches"][0]["memory"][0]["response"] == {"value": "L"}


def test_memory_off_retrieves_nothing_but_still_remembers(tmp_path):
    store = Store(tmp_path / "m.db")
    memory = RehearsalMemory(store, [t("get", {"value": "XL"}, source="committed", task_id="mock:other", key="size")])
    policy = ScriptedPolicy([[call("get", key="size")]], predict=lambda text: {"value": "M"})
    runner = EpisodeRunner(envs.load_task("mock:kv"), policy,
                           RunSettings(mode="parallel", branches=1, memory="off"), memory=memory)
    step = runner.step()
    assert step.chosen_branch.memory == [] and MEMORY_HEADER not in policy.rehearse_calls[0][0].messages[1]["content"]
    assert len(memory) == 2


@pytest.mark.parametrize("text, loops", [
    ('{"error": "mkdir: No such directory: No such user: No such group: No such dir: No such"}', True),
    ('{"error": "mkdir: No such directory: No such user: No such group: No such"}', False),  # four: real records do
    ('{"a": "No such file", "b": "No such dir", "c": "No such thing", "d": "No such x", "e": "No such y"}', False),
    ('{"lines": ["a b c a b c a b c a b c a b c"]}', False),  # short words are not a phrase
    ('{"content": "the cat sat on the mat; the cat sat on the mat; the cat sat on the mat; the cat sat on the mat; '
     'the cat"}', True),
    ('{"note": "update the system, then update the database; later we update the server and update the docs, '
     'and at last a long pause before we update the rest"}', False),  # repeats, not in a row
])
def test_looping_counts_a_phrase_repeated_more_than_twice_in_one_string(text, loops):
    assert looping(text) is loops


def test_open_string_and_repeated_phrase():
    assert open_string('{"a": "b", "c": "No such') == "No such"
    assert open_string('{"a": "b"}') is None
    assert open_string('{"a": "say \\"hi') == 'say \\"hi'
    assert repeated_phrase("No such a; No such b; No such c; No such d; No such e") == "no such"
    assert repeated_phrase("No such a; No such b; No such c; No such d") is None
