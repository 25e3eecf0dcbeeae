"""The cross-step prefix cache: exact reuse of a stored prompt prefix's KV, bounded memory, and the
same greedy text with and without it (prompts, then whole held-out episodes) on the real model."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from app import envs
from app.training.agent import run_episode
from app.config import DEFAULT_RELEVANCE, SHIPPED_ADAPTER
from app.records import RunSettings
from model_backend import GenerationConfig, Prompt, load_policy
from model_backend.decoding import new_cache
from model_backend.prefix_cache import PrefixCache

pytestmark = pytest.mark.slow


def kv_of(base_policy: Any, ids: list[int]) -> Any:
    cache = new_cache(base_policy.model.config)
    with torch.inference_mode():
        base_policy.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def test_lookup_finds_the_longest_stored_prefix_and_restores_it_exactly(base_policy: Any) -> None:
    ids = list(range(100, 160))
    other = list(range(100, 130)) + list(range(500, 540))
    cache = PrefixCache()
    cache.store(ids[:40], kv_of(base_policy, ids[:40]))
    cache.store(other, kv_of(base_policy, other))
    assert len(cache) == 2
    target = new_cache(base_policy.model.config)
    assert cache.restore(ids, target) == 40  # the 40-token entry shares 40, the other only 30
    full = kv_of(base_policy, ids)
    for got, want in zip(target.layers, full.layers):
        assert torch.allclose(got.keys, want.keys[..., :40, :], atol=1e-3, rtol=1e-3)
        assert torch.allclose(got.values, want.values[..., :40, :], atol=1e-3, rtol=1e-3)
    assert cache.stats.hits == 1 and cache.stats.reused_tokens == 40 and cache.stats.computed_tokens == 20

    # At least one token is always left to compute, short prefixes are misses, an entry that is a
    # prefix of a newer one is dropped, and the byte budget evicts the least recently used entry.
    assert cache.restore(ids[:40], new_cache(base_policy.model.config)) == 39
    assert cache.restore(list(range(100, 110)) + [7] * 20, new_cache(base_policy.model.config)) == 0
    cache.store(ids, kv_of(base_policy, ids))
    assert len(cache) == 2 and ids[:40] not in [list(k) for k in cache._entries]
    small = PrefixCache(max_bytes=int(cache.nbytes * 0.9))
    small.store(other, kv_of(base_policy, other))
    small.store(ids, kv_of(base_policy, ids))
    assert len(small) == 1 and small.restore(other, new_cache(base_policy.model.config)) == 30  # only `ids` is left
    cache.clear()
    assert len(cache) == 0 and cache.restore(ids, new_cache(base_policy.model.config)) == 0


def test_growing_prompts_decode_the_same_with_and_without_the_cache(base_policy: Any) -> None:
    system = "You are a helpful assistant that works in a file system. Answer briefly."
    turns = ["List the files.", "Now open the largest one.", "Count its lines, then sort them."]
    config = GenerationConfig(max_new_tokens=24)
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    cached, plain = [], []
    cache = base_policy.prefix_cache
    assert cache is not None
    cache.clear()
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        prompt = Prompt(list(messages))
        cached.append(base_policy.act(prompt, 2, config))
        base_policy.prefix_cache = None
        try:
            plain.append(base_policy.act(prompt, 2, config))
        finally:
            base_policy.prefix_cache = cache
        messages.append({"role": "assistant", "content": cached[-1][0].text})
    for with_cache, without in zip(cached, plain):
        assert [g.text for g in with_cache] == [g.text for g in without]
        for a, b in zip(with_cache, without):
            assert a.token_logprobs == pytest.approx(b.token_logprobs, abs=1e-3)
    assert cache.stats.hits >= len(turns) - 1 and cache.stats.reused_tokens > 100


def test_held_out_episodes_are_the_same_with_and_without_the_cache() -> None:
    """Act, Rehearse and scoring prompts of real episodes of the shipped agent, greedy (K=1), 3 held-out tasks,
    with the tool ranking on (its names scored as a token tree, the channel's tool lines restored from
    the prompt cache) and off: no cache at all, no score memo."""
    policy = load_policy("embedded", adapter=SHIPPED_ADAPTER)
    settings = RunSettings(mode="parallel", branches=1, selector="logprob", shadow=False, max_steps_per_turn=2,
                           max_action_tokens=40, max_rehearsal_tokens=40, relevance=DEFAULT_RELEVANCE)
    cache, prompts = policy.prefix_cache, policy.prompt_cache
    for task_id in envs.list_tasks("multi_turn_base", "heldout")[:3]:
        cache.clear()
        policy.forget_scores(prompts=False)  # the tool lines of earlier tasks stay, as in a session
        with_cache = run_episode(task_id, policy, settings, max_turns=1)
        reused = cache.stats.reused_tokens
        policy.prefix_cache = policy.prompt_cache = None
        policy.forget_scores()
        try:
            without = run_episode(task_id, policy, settings, max_turns=1)
        finally:
            policy.prefix_cache, policy.prompt_cache = cache, prompts
        texts = [[(b.action_text, b.predicted_text) for b in s.branches] for s in with_cache.steps]
        assert texts == [[(b.action_text, b.predicted_text) for b in s.branches] for s in without.steps]
        assert len(with_cache.steps) >= 2
    assert reused > 0


def test_rehearse_rows_are_kept_and_scoring_restores_each_prompt(base_policy: Any) -> None:
    """K Rehearse prompts share the history and differ after it: their decoding keeps each whole prompt, so
    scoring real responses under them (surprise) restores each prompt instead of encoding its suffix
    again, with the same log-probabilities as without the cache."""
    cache = base_policy.prefix_cache
    assert cache is not None
    cache.clear()
    history = "Calls so far and their real results:\n" + "\n".join(
        f'cd(folder="dir{i}") -> {{"current_working_directory": "dir{i}"}}' for i in range(12))
    tools = ["ls(a: bool = False): List the contents of the current directory, hidden files too when asked.",
             "pwd(): Return the current working directory path, from the root of the file system.",
             "du(human_readable: bool = False): Estimate the disk usage of the current directory in bytes."]
    prompts = [Prompt([{"role": "system", "content": "You simulate a file system API. Reply with JSON only."},
                       {"role": "user", "content": f"{history}\n\nTool: {tool}\nCall: {tool.split(':')[0]}"}],
                      prefill="<execution_result>") for tool in tools]
    base_policy.rehearse(prompts, GenerationConfig(max_new_tokens=4))
    ids = [base_policy.encode(p) for p in prompts]
    assert all(cache.covered(i) == len(i) for i in ids)
    responses = ['{"current_directory_content": ["a.txt"]}</execution_result>',
                 '{"current_working_directory": "/dir11"}</execution_result>',
                 '{"disk_usage": "2048 bytes"}</execution_result>']
    hits, reused = cache.stats.hits, cache.stats.reused_tokens
    with_cache = base_policy.score(prompts, responses)
    assert cache.stats.hits - hits == len(prompts)  # one restore per prompt, each of nearly all of it
    assert cache.stats.reused_tokens - reused >= sum(len(i) for i in ids) - 2 * len(ids)
    base_policy.prefix_cache = None
    base_policy.forget_scores()  # else the memo would answer with the cached run's own figures
    try:
        without = base_policy.score(prompts, responses)
    finally:
        base_policy.prefix_cache = cache
    for a, b in zip(with_cache, without):
        assert a == pytest.approx(b, abs=1e-3)
