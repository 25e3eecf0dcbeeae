"""The shipped agent (fixtures/adapters/envace-smollm2-135m): it is the embedded default, its card
holds the held-out proof, and the real weights beat the base on tasks it never trained on.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from app import envs
from app.config import SHIPPED_ADAPTER, resolve_adapter, shipped_adapter
from app.formats import parse_action
from app.records import DEFAULT_REHEARSAL_CONTEXT
from app.training.rows import PromptContext, expert_rows
from model_backend.training import BASE_MODEL_ID

HELDOUT = envs.list_tasks("multi_turn_base", "heldout")


def card() -> dict:
    return json.loads((SHIPPED_ADAPTER / "training.json").read_text())


def test_the_adapter_ships_for_the_embedded_base_and_is_the_default() -> None:
    config = json.loads((SHIPPED_ADAPTER / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == BASE_MODEL_ID and config["peft_type"] == "LORA"
    assert shipped_adapter() is not None
    assert resolve_adapter("embedded", None) == shipped_adapter() == resolve_adapter("embedded", "default")
    assert resolve_adapter("embedded", "none") is None
    assert resolve_adapter("hf:some/model", None) is None  # another base model never gets it


def test_the_card_shows_the_adapter_beating_the_base_on_heldout_tasks() -> None:
    c = card()
    held = c["heldout"]
    assert set(held["adapter"]["tasks"]) <= set(HELDOUT) and held["adapter"]["tasks"] == held["base"]["tasks"]
    assert not set(held["adapter"]["tasks"]) & set(envs.list_tasks("multi_turn_base", "train"))
    assert held["adapter"]["call_accuracy"] > held["base"]["call_accuracy"]
    assert held["adapter"]["forced"]["exact"] > held["base"]["forced"]["exact"]
    assert held["adapter"]["forced"]["n"] == held["base"]["forced"]["n"] > 0
    # The card's own columns: tools ranked by the noisy channel (the default) against the same weights without.
    assert held["adapter"]["relevance"] > 0 and held["adapter_unranked"].get("relevance", 0.0) == 0.0
    assert held["adapter_unranked"]["tasks"] == held["adapter"]["tasks"]
    assert held["adapter"]["call_accuracy"] > held["adapter_unranked"]["call_accuracy"]
    assert c["train_seconds"] < 90 * 60  # the budget on 2 cores
    text = (SHIPPED_ADAPTER / "README.md").read_text()
    assert "## Held-out results" in text and f"Episodes: {len(held['adapter']['tasks'])} tasks" in text
    assert "| tool ranking weight (relevance) | " in text and "this adapter, no tool ranking" in text
    # The card measured the product's default Rehearse prompt, and says which prompt each column saw.
    assert held["adapter"]["rehearsal_context"] == DEFAULT_REHEARSAL_CONTEXT
    assert "| Rehearse prompt (rehearsal context) | " in text and c["eval_note"] in text


def sha256(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


ADAPTER_SHA = sha256(SHIPPED_ADAPTER / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def models():
    import model_backend

    base = model_backend.load_model("embedded")
    adapter = model_backend.load_model("embedded", adapter=SHIPPED_ADAPTER)
    return base, adapter


@pytest.fixture(scope="module")
def heldout_rows(models):
    """Expert Act and Rehearse rows of the first 4 held-out tasks, in task order, as the engine renders them."""
    tok = models[0].tokenizer
    ctx = PromptContext(lambda text: len(tok.encode(text, add_special_tokens=False)), 8192)
    return expert_rows(HELDOUT[:4], ctx)[0]


@pytest.mark.slow
def test_heldout_expert_calls_and_responses_are_likelier_under_the_adapter(models, heldout_rows) -> None:
    from model_backend.training import encode_rows, nll_of_rows

    base, adapter = models
    means = {}
    for role in ("act", "rehearse"):
        rows = [r for r in heldout_rows if r.role == role][:6]
        encoded, _ = encode_rows(base.tokenizer, rows, max_seq_len=2000, pack_len=None)
        assert encoded, role
        means[role] = {name: sum(nll_of_rows(m.model, encoded)) / len(encoded)
                       for name, m in (("base", base), ("adapter", adapter))}
    print(f"held-out NLL per target token: {means}")
    for role, nll in means.items():
        assert nll["adapter"] < nll["base"] / 2, (role, nll)


@pytest.mark.slow
def test_the_adapter_calls_real_tools_where_the_base_writes_prose(models, heldout_rows) -> None:
    from model_backend.base import GenerationConfig
    from model_backend.policy import TransformersPolicy

    firsts = {r.ref.split("/")[0]: r for r in reversed(heldout_rows) if r.role == "act"}  # each task's first Act row
    config = GenerationConfig(max_new_tokens=64, temperature=0.0, stop=("</tool_call>",))
    calls = {}
    for name, m in zip(("base", "adapter"), models):
        policy = TransformersPolicy(m)
        kinds = []
        for task_ref, row in sorted(firsts.items()):
            tools = {t.name for t in envs.make_env(envs.load_task(task_ref.removeprefix("expert-"))).tools()}
            action = parse_action(policy.act(row.prompt, 1, config)[0].text)
            kinds.append(action.kind == "call" and action.call.name in tools)
        calls[name] = sum(kinds)
    print(f"first steps of {len(firsts)} held-out tasks with a call to a real tool: {calls}")
    assert calls["base"] == 0 and calls["adapter"] >= len(firsts) // 2


@pytest.mark.slow
def test_inference_policies_merge_the_adapter_and_say_the_same(models, heldout_rows) -> None:
    import model_backend
    from model_backend.base import GenerationConfig
    from model_backend.policy import TransformersPolicy

    _, adapter = models
    merged = model_backend.load_policy("embedded", adapter=SHIPPED_ADAPTER)
    assert Path(merged.loaded.adapter).resolve() == SHIPPED_ADAPTER.resolve()  # cached: maybe loaded by a relative path
    assert not any("lora" in name for name, _ in merged.loaded.model.named_modules())
    assert any("lora" in name for name, _ in adapter.model.named_modules())
    config = GenerationConfig(max_new_tokens=40, temperature=0.0, stop=("</tool_call>",))
    unmerged = TransformersPolicy(adapter)
    for row in [r for r in heldout_rows if r.role == "act"][:3]:
        assert merged.act(row.prompt, 1, config)[0].text == unmerged.act(row.prompt, 1, config)[0].text
    assert sha256(SHIPPED_ADAPTER / "adapter_model.safetensors") == ADAPTER_SHA  # merging wrote nothing to disk
