"""The Run tab's task search (`TaskCatalog.filter`): ids, categories, environment classes, tool names and every
user turn, on the real task files."""
from __future__ import annotations

import pytest

from app import envs
from app.service.catalog import TaskCatalog


@pytest.fixture(scope="module")
def catalog() -> TaskCatalog:
    return TaskCatalog()


@pytest.mark.parametrize("query", ["twitter", "tweet", "post", "TwitterAPI", "post_tweet"])
def test_twitter_words_find_the_twitter_tasks(catalog, query):
    found = {t.id for t in catalog.filter(query=query)}
    twitter = set(catalog.ids_with_class("TwitterAPI"))
    assert twitter and twitter <= found  # every TwitterAPI task: its class and its tools (post_tweet) say so


def test_the_search_looks_in_later_user_turns_not_only_the_first(catalog):
    task = envs.load_task("bfcl:multi_turn_base_0")
    later = next(m["content"] for turn in task.turns[1:] for m in turn if m["content"])
    phrase = " ".join(later.split()[:6])
    assert phrase.lower() not in task.turns[0][0]["content"].lower()
    assert "bfcl:multi_turn_base_0" in {t.id for t in catalog.filter(query=phrase)}


def test_every_word_must_match_and_case_is_ignored(catalog):
    both = {t.id for t in catalog.filter(query="TWEET mkdir")}
    assert both and all({"post_tweet", "mkdir"} <= set(catalog.tasks[i].tools) for i in both)
    assert both < {t.id for t in catalog.filter(query="tweet")}
    assert catalog.filter(query="zzz-no-such-word") == []
    assert len(catalog.filter(query="  ")) == len(catalog.tasks)


def test_search_combines_with_the_filters_and_finds_tau2_and_mock_tools(catalog):
    airline = catalog.filter(category="airline", query="cancel_reservation")
    assert airline and all(t.category == "airline" for t in airline)
    assert [t.id for t in catalog.filter(env_class="MockKV", query="list_keys")] == ["mock:kv"]
    assert catalog.filter(env_class="MathAPI") and catalog.filter(env_class="MathAPI", query="post_tweet") == []


def test_tool_names_hide_a_tasks_excluded_tools():
    task = next(t for t in map(envs.load_task, envs.list_tasks("multi_turn_miss_func")) if t.excluded_functions)
    names = envs.tool_names(task)
    assert names and not set(task.excluded_functions) & set(names)
