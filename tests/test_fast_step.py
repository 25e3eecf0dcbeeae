"""The lean decode step: the logits of the model's own forward to float rounding and the same greedy tokens
(fp32 and fp16 weights), the same greedy text as plain `generate` (fp16 weights), fused weights rebuilt
when the weights change, and the ordinary forward wherever it does not apply."""
from __future__ import annotations

import pytest
import torch

from model_backend import GenerationConfig, ModelSpecError, load_policy
from model_backend import decoding, fast_step
from model_backend.loading import weights_format
from decode_check import assert_same_function, decode_logits, user


@pytest.mark.parametrize("value, expected", [(None, "fp32"), ("FP32", "fp32"), (" fp16 ", "fp16")])
def test_weights_format(value: str | None, expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENVACE_WEIGHTS", raising=False)
    assert weights_format(value) == expected
    monkeypatch.setenv("ENVACE_WEIGHTS", "fp16")
    assert weights_format(None) == "fp16"
    for removed in ("int8", "int4"):  # int8 was removed (CPU-dependent arithmetic): a clear user error
        with pytest.raises(ModelSpecError, match="fp32, fp16"):
            weights_format(removed)


@pytest.mark.slow
def test_lean_step_computes_the_forwards_logits() -> None:
    policy = load_policy("embedded", weights="fp32")
    model = policy.model
    assert fast_step.lean_supported(model, decoding.new_cache(model.config))
    ids = policy.encode(user("List the files, then count the lines of the largest one."))
    # batch 1 without a mask; batch 3 with suffix padding between a shared prefix and the rows
    for seqs in ([ids], [ids, ids[:-3] + [28, 29, 30, 31], ids[:-6]]):
        assert_same_function(decode_logits(model, seqs, fast_step.lean_step),
                             decode_logits(model, seqs, fast_step.generic_step))


def test_fused_weights_follow_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The concatenated q/k/v and gate/up weights are built once per set of weights, and rebuilt when a
    weight is written in place (a merge, an optimizer step): a stale copy would decode the old model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    assert fast_step.lean_supported(model, decoding.new_cache(model.config))
    built = []
    real = fast_step.fused_linear
    monkeypatch.setattr(fast_step, "fused_linear", lambda ms: built.append(len(ms)) or real(ms))
    seqs = [[1, 5, 9, 3, 7]]
    first = decode_logits(model, seqs, fast_step.lean_step, steps=2)
    decode_logits(model, seqs, fast_step.lean_step, steps=2)
    assert len(built) == 2 * config.num_hidden_layers  # once for both runs: qkv and gate_up per layer
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(3.0)
    changed = decode_logits(model, seqs, fast_step.lean_step, steps=2)
    assert len(built) == 4 * config.num_hidden_layers
    assert not torch.allclose(first, changed)
    assert_same_function(changed, decode_logits(model, seqs, fast_step.generic_step, steps=2))


@pytest.mark.slow
def test_hooks_fall_back_to_the_forward() -> None:
    model = load_policy("embedded").model
    handle = model.register_forward_hook(lambda *_: None)
    try:
        assert not fast_step.lean_supported(model, decoding.new_cache(model.config))
    finally:
        handle.remove()


@pytest.mark.slow
def test_fp16_weights_lean_step_and_text(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = load_policy("embedded", weights="fp16")
    assert policy.loaded.weights == "fp16"
    monkeypatch.delenv("ENVACE_WEIGHTS", raising=False)
    assert load_policy("embedded") is policy  # fp16 is the CPU inference default
    model = policy.model
    assert fast_step.lean_supported(model, decoding.new_cache(model.config))
    prompts = [user("ls()", prefill="<execution_result>"), user("pwd() after cd(folder='documents')")]
    ids = [policy.encode(p) for p in prompts]
    assert_same_function(decode_logits(model, ids, fast_step.lean_step, 5),
                         decode_logits(model, ids, fast_step.generic_step, 5))
    # Weight-only: rows stay independent, so a batch decodes as each row alone, and as plain generate.
    config = GenerationConfig(max_new_tokens=12)
    assert [g.text for g in policy.rehearse(prompts, config)] == [policy.reference_generate(p, 12) for p in prompts]


def test_shared_prefix_attention_is_attention_over_both_parts() -> None:
    """The prefix read once for all rows, merged with each row's own (padded) keys, is plain attention over
    [prefix | own]."""
    torch.manual_seed(0)
    batch, kv_heads, groups, dim, shared, own = 3, 2, 3, 16, 11, 5
    q = torch.randn(batch, kv_heads, groups, dim)
    shared_k, shared_v = torch.randn(1, kv_heads, shared, dim), torch.randn(1, kv_heads, shared, dim)
    own_k, own_v = torch.randn(batch, kv_heads, own, dim), torch.randn(batch, kv_heads, own, dim)
    own_mask = torch.ones(batch, 1, 1, own, dtype=torch.bool)
    own_mask[1, ..., :2] = False  # row 1's suffix is shorter: two pads after the prefix
    out = fast_step.shared_prefix_attention(q, shared_k, shared_v, own_k, own_v, own_mask, 0.25)
    keys = torch.cat([shared_k.expand(batch, -1, -1, -1), own_k], dim=-2)
    values = torch.cat([shared_v.expand(batch, -1, -1, -1), own_v], dim=-2)
    mask = torch.cat([torch.ones(batch, 1, 1, shared, dtype=torch.bool), own_mask], dim=-1)
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.25)
    assert torch.allclose(out, expected, atol=1e-5)


def test_rows_keep_one_copy_of_their_shared_prefix() -> None:
    """K rows of one prompt: the prefix's keys stay at batch 1 in the cache, and K greedy rows decode what one
    row decodes alone (lean step with shared-prefix attention, against the forward)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).eval()
    prompt = [1, 5, 9, 3, 7, 11, 2, 8]
    with torch.inference_mode():
        pre = decoding.prefill(model, [prompt] * 4, [1] * 4, keep=1, pad_id=0)
    layer = pre.cache.layers[0]
    assert layer.shared_keys is not None and layer.shared_keys.shape[0] == 1
    assert layer.shared_len == len(prompt) - 1 and pre.cache.get_seq_length() == len(prompt)
    together = decode_logits(model, [prompt] * 4, fast_step.lean_step, steps=4)
    alone = decode_logits(model, [prompt], fast_step.generic_step, steps=4)
    for row in range(4):
        assert_same_function(together[:, row : row + 1], alone)


def test_a_chunk_of_tokens_through_the_lean_step_is_the_forwards() -> None:
    """Jump-forward feeds several tokens per row in one step (left-padded to the longest): the lean step's
    logits at every real position, and the next single step's, are the forward's, with a shared prefix, pads
    between prefix and suffix, and pads inside the chunk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(2)
    model = LlamaForCausalLM(config).eval()
    seqs = [[1, 5, 9, 3, 7, 11], [1, 5, 9, 3, 4], [1, 5, 9, 3, 8, 12, 13]]
    feeds = [[20, 21, 22], [23], [24, 25]]
    results = []
    for maker in (fast_step.lean_step, fast_step.generic_step):
        with torch.inference_mode():
            pre = decoding.prefill(model, seqs, [1] * 3, keep=1, pad_id=0)
            step = maker(model, pre.cache)
            ids, chunk_mask, positions, lengths = decoding._chunk(feeds, pre.next_positions, 0)
            mask = torch.cat([pre.attention_mask, chunk_mask], dim=1)
            chunk = step(ids, mask, positions)
            mask = torch.cat([mask, torch.ones((3, 1), dtype=mask.dtype)], dim=1)
            after = step(torch.tensor([[30], [31], [32]]), mask, (pre.next_positions + lengths)[:, None])
        real = [chunk[i, 3 - len(f):] for i, f in enumerate(feeds)]
        results.append((real, after))
    (lean_chunk, lean_after), (forward_chunk, forward_after) = results
    for a, b in zip(lean_chunk, forward_chunk):
        assert_same_function(a, b)
    assert_same_function(lean_after, forward_after)


def test_the_accelerator_turns_off_as_a_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ENVACE_FAST_STEP=0`: the decoder's one entry point gives the ordinary forward, and fp16 layers are torch's
    own (no native layer): the accelerator is optional as a whole, and the logits stay the forward's."""
    from torch.ao.nn.quantized.dynamic import Linear as QuantizedLinear
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_backend import loading

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    cache = decoding.new_cache(model.config)
    assert fast_step.enabled() and fast_step.decode_step(model, cache).__qualname__.startswith("lean_step")
    seqs = [[1, 5, 9, 3, 7]]
    on = decode_logits(model, seqs, fast_step.decode_step, steps=2)
    monkeypatch.setenv(fast_step.ENV, "0")
    assert not fast_step.enabled()
    assert fast_step.decode_step(model, cache).__qualname__.startswith("generic_step")
    off = decode_logits(model, seqs, fast_step.decode_step, steps=2)
    assert_same_function(on, off)
    quantized = loading.quantize_linears(LlamaForCausalLM(config).eval(), "fp16")
    layers = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
    assert layers and not any(isinstance(m, fast_step.NativeLinear) for m in layers)
    monkeypatch.setenv(fast_step.ENV, "1")
    again = loading.quantize_linears(LlamaForCausalLM(config).eval(), "fp16")
    assert any(isinstance(m, fast_step.NativeLinear) for m in again.modules())
