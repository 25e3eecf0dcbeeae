"""The lean decode step: bitwise the logits of the model's own forward (fp32, fp16 and int8 weights), the same
greedy text as plain `generate` (fp16 weights), and the ordinary forward wherever it does not apply."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from model_backend import GenerationConfig, ModelSpecError, Prompt, load_policy
from model_backend import decoding, fast_step
from model_backend.loading import weights_format


def user(text: str, prefill: str = "") -> Prompt:
    return Prompt([{"role": "system", "content": "You are a file system API. Reply briefly."},
                   {"role": "user", "content": text}], prefill=prefill)


@pytest.mark.parametrize("value, expected", [(None, "fp32"), ("INT8", "int8"), (" fp16 ", "fp16")])
def test_weights_format(value: str | None, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENVACE_WEIGHTS", raising=False)
    assert weights_format(value) == expected
    monkeypatch.setenv("ENVACE_WEIGHTS", "int8")
    assert weights_format(None) == "int8"
    with pytest.raises(ModelSpecError, match="fp32, fp16, int8"):
        weights_format("int4")


def decode_logits(model: Any, seqs: list[list[int]], maker: Any, steps: int = 5) -> torch.Tensor:
    """Logits of `steps` greedy decode steps after a (padded) prefill, through one step function."""
    batch = len(seqs)
    with torch.inference_mode():
        pre = decoding.prefill(model, seqs, [1] * batch, keep=1, pad_id=2)
        step, mask, positions = maker(model, pre.cache), pre.attention_mask, pre.next_positions
        tokens, out = pre.logits[:, -1].argmax(-1), []
        for _ in range(steps):
            if pre.has_padding:
                mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype)], dim=1)
            logits = step(tokens[:, None], mask if pre.has_padding else None, positions[:, None])
            positions = positions + 1
            out.append(logits.clone())
            tokens = logits.argmax(-1)
    return torch.stack(out)


@pytest.mark.slow
def test_lean_step_logits_are_bitwise_the_forwards() -> None:
    policy = load_policy("embedded")
    model = policy.model
    assert fast_step.lean_supported(model, decoding.new_cache(model.config))
    ids = policy.encode(user("List the files, then count the lines of the largest one."))
    # batch 1 without a mask; batch 3 with suffix padding between a shared prefix and the rows
    for seqs in ([ids], [ids, ids[:-3] + [28, 29, 30, 31], ids[:-6]]):
        lean = decode_logits(model, seqs, fast_step.lean_step)
        forward = decode_logits(model, seqs, fast_step.generic_step)
        assert torch.equal(lean, forward)


@pytest.mark.slow
def test_hooks_fall_back_to_the_forward() -> None:
    model = load_policy("embedded").model
    handle = model.register_forward_hook(lambda *_: None)
    try:
        assert not fast_step.lean_supported(model, decoding.new_cache(model.config))
    finally:
        handle.remove()


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["fp16", "int8"])
def test_quantized_weights_lean_step_and_text(weights: str) -> None:
    policy = load_policy("embedded", weights=weights)
    assert policy.loaded.weights == weights
    model = policy.model
    assert fast_step.lean_supported(model, decoding.new_cache(model.config))
    prompts = [user("ls()", prefill="<execution_result>"), user("pwd() after cd(folder='documents')")]
    ids = [policy.encode(p) for p in prompts]
    assert torch.equal(decode_logits(model, ids, fast_step.lean_step), decode_logits(model, ids, fast_step.generic_step))
    if weights == "fp16":
        # Weight-only: rows stay independent, so a batch decodes as each row alone, and as plain generate.
        # (int8 quantizes the activations with one scale per call over all rows and positions: its text
        # depends on the batch and on how the prompt is split into calls, so it is not asserted.)
        config = GenerationConfig(max_new_tokens=12)
        assert [g.text for g in policy.rehearse(prompts, config)] == [policy.reference_generate(p, 12) for p in prompts]
