"""The native decode step (`native_decode.c`): the torch lean step's logits to float rounding and the same greedy
tokens, at batch 1 and over a shared prefix with padded rows, on a small random model (attention split into
parts that straddle the prefix) and on the embedded model with the same greedy text; its weights follow the
model; and where it cannot run (turned off, no compiler) the torch step runs instead, with the reason said."""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from model_backend import GenerationConfig, load_policy, native
from model_backend import decoding, fast_step, kv_cache
from model_backend.loading import quantize_linears
from decode_check import assert_same_function, decode_logits, user

pytestmark = pytest.mark.native


def torch_lean(model: Any, cache: Any) -> Any:
    return fast_step.lean_step(model, cache, native_enabled=False)


def tiny_fp16_model(seed: int = 0, hidden: int = 32, heads: int = 4, kv_heads: int = 2) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, attn_implementation="sdpa",
                         max_position_embeddings=2048)
    torch.manual_seed(seed)
    return quantize_linears(LlamaForCausalLM(config).eval(), "fp16")


@pytest.fixture
def built() -> None:
    """The native step's tests run wherever the CPU can run it; on a CPU without AVX2/FMA/F16C (or not
    x86-64) they are skipped with the reason, and anywhere else a failed build fails them (`make setup`
    installs the compiler)."""
    if native.library() is None:
        status = native.status()
        if "the CPU lacks" in status or "is not x86-64" in status:
            pytest.skip(f"the native step cannot run on this CPU: {status}")
        pytest.fail(f"the native step should build on this machine: {status}")


@pytest.mark.parametrize(("hidden", "heads", "kv_heads"), [(32, 4, 2), (192, 3, 1), (256, 4, 2)])
def test_native_step_is_the_torch_steps_function_on_a_small_model(built: None, hidden: int, heads: int,
                                                                   kv_heads: int) -> None:
    """Head dims 8 and 64 (the kernel of 64, SmolLM2's, with three and two query heads a key/value head)."""
    model = tiny_fp16_model(hidden=hidden, heads=heads, kv_heads=kv_heads)
    assert fast_step.native_supported(model)
    generator = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 96, (700,), generator=generator).tolist()
    # Batch 1 over 700 keys (attention in parts); three rows after a 700-token shared prefix, padded
    # to different lengths, so parts straddle the prefix and the rows' own keys and pads are masked.
    for seqs in ([prefix], [prefix + [5, 6, 7, 8], prefix + [9], prefix + [10, 11]]):
        native_logits = decode_logits(model, seqs, fast_step.lean_step, steps=6)
        torch_logits = decode_logits(model, seqs, torch_lean, steps=6)
        assert (native_logits - torch_logits).abs().max().item() < 1e-4
        assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))


def chunked_logits(model: Any, seqs: list[list[int]], feeds: list[list[list[int]]], maker: Any,
                   twins: list[list[int] | None] | None = None) -> list[torch.Tensor]:
    """After a prefill, steps that feed each row its own number of tokens (left-padded to the widest, as
    jump-forward does): the logits of every real position, row by row. `twins[s]`: step s's hint."""
    out = []
    twins = twins or [None] * len(feeds)
    with torch.inference_mode():
        pre = decoding.prefill(model, seqs, [1] * len(seqs), keep=1, pad_id=2)
        step, mask, positions = maker(model, pre.cache), pre.attention_mask, pre.next_positions
        padded = pre.has_padding
        for feed, hint in zip(feeds, twins):
            ids, chunk_mask, chunk_positions, lengths = decoding._chunk(feed, positions, 2)
            if not padded:
                mask = torch.ones((len(seqs), pre.cache.get_seq_length()), dtype=torch.long)
            mask = torch.cat([mask, chunk_mask], dim=1)
            padded = padded or bool((chunk_mask == 0).any())
            logits = step(ids, mask if padded else None, chunk_positions,
                          twins=None if hint is None else torch.tensor(hint))
            width = ids.shape[1]
            out += [logits[i, width - len(f):] for i, f in enumerate(feed)]
            positions = positions + lengths
    return out


@pytest.mark.parametrize("hidden", [32, 192])
def test_native_step_computes_only_real_tokens_of_padded_chunks(built: None, hidden: int) -> None:
    """Rows feeding 1-5 tokens in one step (pads computed by nobody, masked), then single tokens: the torch
    step's logits at every real position, over a shared prefix and without one (head dims 8 and 64)."""
    model = tiny_fp16_model(seed=3, hidden=hidden, heads=4 if hidden == 32 else 3, kv_heads=2 if hidden == 32 else 1)
    generator = torch.Generator().manual_seed(4)
    prefix = torch.randint(3, 96, (300,), generator=generator).tolist()
    for seqs, feeds in (
        ([prefix + [5, 6], prefix + [7], prefix + [8, 9, 10]],
         [[[11, 12, 13], [14], [15, 16]], [[17], [18, 19, 20, 21, 22], [23]], [[24], [25], [26]]]),
        ([prefix], [[[30, 31, 32, 33]], [[34]], [[35, 36]]]),  # one row: no pads, no mask, causal
        # Five rows of one token (products in tiles of three and two rows), then 44 tokens in six rows (the
        # packed product, past 32 rows), then 23 (tiles of up to four rows).
        ([prefix + [40 + i] for i in range(5)], [[[50 + i] for i in range(5)]]),
        ([prefix + [40 + i] for i in range(6)],
         [[list(range(50, 50 + n)) for n in (9, 1, 9, 8, 9, 8)], [[60 + i] * (1 + 2 * i) for i in range(5)] + [[7]]]),
    ):
        native_rows = chunked_logits(model, seqs, feeds, fast_step.lean_step)
        torch_rows = chunked_logits(model, seqs, feeds, torch_lean)
        for n, t in zip(native_rows, torch_rows):
            assert (n - t).abs().max().item() < 1e-4
            assert torch.equal(n.argmax(-1), t.argmax(-1))


def test_twin_rows_copy_their_twins_keys_and_logits(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows 0 and 2 the same sequence, row 1 another: with the `twins` hint the native step computes row 0's
    tokens once for both, and every logit, then and after the rows part, is the torch step's (which computes
    every row): row 2's keys and values, copied from row 0's, are its own."""
    model = tiny_fp16_model(seed=5)
    prefix = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    seqs = [prefix + [5, 6], prefix + [7], prefix + [5, 6]]
    feeds = [[[11, 12, 13], [14], [11, 12, 13]], [[15], [16], [15]], [[17, 18], [19], [20]], [[21], [22], [23]]]
    hints = [[0, 1, 0], [0, 1, 0], None, None]
    computed = []
    lib = native.library()
    pre_attention, all_layers = lib.envace_pre_attention, lib.envace_decode_layers

    def counting(count: int, *rest: Any) -> Any:
        computed.append(count)
        return pre_attention(count, *rest)

    def counting_all(layers: int, count: int, *rest: Any) -> Any:  # a decode step's layers in one call
        computed.extend([count] * layers)
        return all_layers(layers, count, *rest)

    monkeypatch.setattr(lib, "envace_pre_attention", counting)
    monkeypatch.setattr(lib, "envace_decode_layers", counting_all)
    native_rows = chunked_logits(model, seqs, feeds, fast_step.lean_step, hints)
    monkeypatch.setattr(lib, "envace_pre_attention", pre_attention)
    monkeypatch.setattr(lib, "envace_decode_layers", all_layers)
    torch_rows = chunked_logits(model, seqs, feeds, torch_lean)
    for n, t in zip(native_rows, torch_rows):
        assert (n - t).abs().max().item() < 1e-4
        assert torch.equal(n.argmax(-1), t.argmax(-1))
    layers = model.config.num_hidden_layers
    # 3 + 1 tokens (row 2's three copied), 1 + 1, then all three rows' 2 + 1 + 1 and 1 + 1 + 1.
    assert computed == [4] * layers + [2] * layers + [4] * layers + [3] * layers


def test_the_cache_after_native_decode_steps_is_the_torch_steps(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps through `envace_decode_layers` write keys and values into the cache's buffers themselves:
    the cache then holds what the torch step's appends hold (its `keys`/`values` views included)."""
    model = tiny_fp16_model(hidden=192, heads=3, kv_heads=1)
    ids = list(range(3, 40))
    lib = native.library()
    all_layers, calls = lib.envace_decode_layers, []
    monkeypatch.setattr(lib, "envace_decode_layers", lambda *a: calls.append(a[1]) or all_layers(*a))
    caches = []
    for maker in (fast_step.lean_step, torch_lean):
        with torch.inference_mode():
            pre = decoding.prefill(model, [ids], [1], keep=1, pad_id=2)
            step, positions = maker(model, pre.cache), pre.next_positions
            for token in (5, 6, 7):
                step(torch.tensor([[token]]), None, positions[:, None])
                positions = positions + 1
        caches.append(pre.cache)
    assert calls == [1, 1, 1]
    for native_layer, torch_layer in zip(caches[0].layers, caches[1].layers):
        assert native_layer.get_seq_length() == torch_layer.get_seq_length() == len(ids) + 3
        assert native_layer.keys.shape == torch_layer.keys.shape
        assert (native_layer.keys - torch_layer.keys).abs().max().item() < 1e-4
        assert (native_layer.values - torch_layer.values).abs().max().item() < 1e-4


def test_a_layer_written_in_place_shows_its_new_length_whichever_view_is_set_first() -> None:
    """After the one-call decode writes keys and values into a layer's buffers (`wrote`), its views are made when
    read; setting one of the pair (as `append` and `update` do, keys first) leaves the other view current."""
    layer = kv_cache.GrowingLayer()
    layer.append(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    written = torch.randn(1, 2, 1, 4)
    layer._k[..., 3:4, :], layer._v[..., 3:4, :] = written, written + 1  # what the C call does
    layer.wrote(4)
    replacement = torch.zeros(1, 2, 4, 4)
    layer.keys = replacement
    assert layer.keys is replacement
    assert layer.values.shape[-2] == 4 and torch.equal(layer.values[..., 3:4, :], written + 1)
    assert layer.get_seq_length() == 4


def test_a_step_with_many_tokens_stays_with_torch(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past NATIVE_STEP_MAX_TOKENS real tokens (a prefill) the native step declines: torch runs the step."""
    model = tiny_fp16_model()
    calls = []
    real = fast_step._native_step

    def counting(*args: Any) -> Any:
        step = real(*args)
        return lambda *a: calls.append(step(*a))

    monkeypatch.setattr(fast_step, "_native_step", counting)
    with torch.inference_mode():
        cache = decoding.new_cache(model.config)
        n = fast_step.NATIVE_STEP_MAX_TOKENS + 1
        fast_step.lean_step(model, cache)(torch.arange(3, 3 + n)[None] % model.config.vocab_size, None,
                                          torch.arange(n)[None])
    assert calls == [None]


@pytest.mark.parametrize(("rows", "out", "inner"), [(17, 16, 32), (23, 112, 264), (100, 192, 48)])
def test_native_products_of_many_rows(built: None, rows: int, out: int, inner: int) -> None:
    """`envace_gemm` against fp32 products of the widened weights: tails of rows (not a multiple of 6), of
    columns (a block of 96 part full) and of K (a block of 256 and 8 more) included."""
    generator = torch.Generator().manual_seed(rows)
    h = torch.randn(1, rows, inner, generator=generator)
    weight = (torch.randn(out, inner, generator=generator) * 0.1).half()
    product = fast_step.native_matmul(h, weight)
    assert product is not None and product.shape == (1, rows, out)
    reference = h.double() @ weight.double().T
    assert (product.double() - reference).abs().max().item() < 1e-5 * inner ** 0.5
    # Decode-sized inputs, other dtypes and sizes its tiles do not take are not its to compute.
    assert fast_step.native_matmul(h[:, :16], weight) is None
    assert fast_step.native_matmul(h.double(), weight) is None
    assert fast_step.native_matmul(h, weight[:8]) is None


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 9])
@pytest.mark.parametrize("out", [1, 2, 7, 13, 48, 101])
def test_decode_sized_products_cover_every_weight_row(built: None, rows: int, out: int) -> None:
    """The head's product (`envace_head`: rms norm, then `gemv` of a few rows) against fp64 on the widened
    weights, with weight-row counts that split unevenly over the threads and over each thread's four streams
    (one row of x) or three (tiles of 2-4 rows), so that every remainder path runs."""
    import ctypes

    hidden = 48
    generator = torch.Generator().manual_seed(rows * 1000 + out)
    x = torch.randn(rows, hidden, generator=generator)
    norm = torch.rand(hidden, generator=generator) + 0.5
    head = (torch.randn(out, hidden, generator=generator) * 0.1).half()
    logits, scratch = torch.full((rows, out), float("nan")), torch.empty(rows, hidden)
    native.library().envace_head(rows, hidden, out, x.data_ptr(), norm.data_ptr(), ctypes.c_float(1e-5),
                                 head.data_ptr(), logits.data_ptr(), scratch.data_ptr())
    h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.double()
    assert (logits.double() - h @ head.double().T).abs().max().item() < 1e-5


def test_native_linear_runs_many_rows_natively_until_its_weight_changes(built: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A `NativeLinear` computes prefill-sized inputs natively, as fbgemm does to float rounding; a weight
    replaced since the native copy was made, or the native step turned off, goes back to fbgemm."""
    model = tiny_fp16_model()
    fast_step.prepare_native(model)
    up = model.model.layers[0].mlp.up_proj
    assert isinstance(up, fast_step.NativeLinear) and up.native_weight is not None
    calls = []
    real = fast_step.native_matmul
    monkeypatch.setattr(fast_step, "native_matmul", lambda h, w: calls.append(h.shape) or real(h, w))
    h = torch.randn(2, 20, 32)
    fbgemm = torch.ops.quantized.linear_dynamic_fp16(h, up._packed_params._packed_params)
    assert (up(h) - fbgemm).abs().max().item() < 1e-5 and calls == [h.shape]
    native.use(False)
    try:
        assert torch.equal(up(h), fbgemm)
    finally:
        native.use(True)
    weight, bias = up._packed_params._weight_bias()
    up.set_weight_bias(weight * 3.0, bias)
    tripled = torch.ops.quantized.linear_dynamic_fp16(h, up._packed_params._packed_params)
    assert (tripled - fbgemm).abs().max().item() > 0.1  # the stale copy's product would be caught
    calls.clear()
    assert torch.equal(up(h), tripled) and calls == []  # the stale copy is not used
    with torch.inference_mode():  # a lean step rebuilds the copy, with the new weight
        fast_step.lean_step(model, decoding.new_cache(model.config))
    assert up.native_weight is not None and up.native_weight[0] is up._packed_params._packed_params
    assert (up(h) - tripled).abs().max().item() < 1e-5 and calls == [h.shape]


def test_native_weights_follow_the_model(built: None) -> None:
    """A weight replaced (a merge, a reload) rebuilds the native copy: a stale one would decode the old model."""
    model = tiny_fp16_model()
    seqs = [[1, 5, 9, 3, 7] * 4]
    first = decode_logits(model, seqs, fast_step.lean_step, steps=3)
    weights = fast_step._native_weights(model)
    assert weights is not None and fast_step._native_weights(model) is weights  # built once
    up = model.model.layers[1].mlp.up_proj
    weight, bias = up._packed_params._weight_bias()
    up.set_weight_bias(weight * 3.0, bias)
    changed = decode_logits(model, seqs, fast_step.lean_step, steps=3)
    assert fast_step._native_weights(model) is not weights
    assert not torch.allclose(first, changed)
    assert_same_function(changed, decode_logits(model, seqs, fast_step.generic_step, steps=3))


def test_only_fp16_models_run_natively(built: None) -> None:
    """fp32 weights would change arithmetic in the C step: they keep the torch step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    assert not fast_step.native_supported(LlamaForCausalLM(config).eval())
    odd = LlamaConfig(vocab_size=64, hidden_size=40, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    assert not fast_step.native_supported(quantize_linears(LlamaForCausalLM(odd).eval(), "fp16"))  # 40 % 16
    biased = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", attention_bias=True)
    biased_model = quantize_linears(LlamaForCausalLM(biased).eval(), "fp16")
    assert fast_step._native_weights(biased_model) is None  # the C step adds no bias
    assert_same_function(decode_logits(biased_model, [[1, 2, 3]], fast_step.lean_step, steps=2),
                         decode_logits(biased_model, [[1, 2, 3]], fast_step.generic_step, steps=2))


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    """A native module that decides afresh (its library and status forgotten), building into tmp_path."""
    monkeypatch.setenv("ENVACE_CACHE_DIR", str(tmp_path))
    native.reset_for_tests()
    yield monkeypatch
    native.reset_for_tests()


def test_turned_off_the_torch_step_runs(fresh_native: pytest.MonkeyPatch) -> None:
    fresh_native.setenv(native.ENV, "0")
    assert native.library() is None
    assert native.status() == "off ($ENVACE_NATIVE=0)"
    model = tiny_fp16_model()
    assert fast_step._native_weights(model) is None
    assert_same_function(decode_logits(model, [[1, 2, 3]], fast_step.lean_step, steps=2),
                         decode_logits(model, [[1, 2, 3]], fast_step.generic_step, steps=2))


def test_a_failed_build_says_why_and_the_torch_step_runs(fresh_native: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    fresh_native.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING):
        assert native.library() is None
    assert native.status().startswith("not built: /bin/false failed")
    assert "the torch step runs instead" in caplog.text
    model = tiny_fp16_model()
    assert_same_function(decode_logits(model, [[1, 2, 3]], fast_step.lean_step, steps=2),
                         decode_logits(model, [[1, 2, 3]], fast_step.generic_step, steps=2))


def test_a_fresh_build_lands_in_the_cache(fresh_native: pytest.MonkeyPatch, tmp_path: Any) -> None:
    assert native.library() is not None
    built_files = list((tmp_path / "native-decode").glob("envace_decode-*.so"))
    assert len(built_files) == 1 and native.status() == f"on ({built_files[0]})"


@pytest.mark.slow
def test_native_step_on_the_embedded_model(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model's fp16 logits as the torch step's, and the same greedy text as plain `generate`, with
    a batch whose finished row is masked (the native step then computes only the live row); sampled twin rows
    write what each writes alone."""
    live_rows = []
    real = fast_step._native_step

    def watching(*args: Any) -> Any:
        step = real(*args)

        def watched(ids: torch.Tensor, mask: Any, *rest: Any) -> Any:
            if ids.shape[1] == 1 and mask is not None:
                live_rows.append(int(mask[:, -1].sum()))
            return step(ids, mask, *rest)
        return watched

    monkeypatch.setattr(fast_step, "_native_step", watching)
    policy = load_policy("embedded", weights="fp16")
    model = policy.model
    assert fast_step._native_weights(model) is not None
    ids = policy.encode(user("List the files, then count the lines of the largest one."))
    for seqs in ([ids], [ids, ids[:-3] + [28, 29, 30, 31], ids[:-6]]):
        assert_same_function(decode_logits(model, seqs, fast_step.lean_step),
                             decode_logits(model, seqs, torch_lean))
    prompts = [user("ls()", prefill="<execution_result>"), user("pwd() after cd(folder='documents')"), user("Say hi.")]
    config = GenerationConfig(max_new_tokens=24)
    live_rows.clear()
    assert [g.text for g in policy.rehearse(prompts, config)] == [policy.reference_generate(p, 24) for p in prompts]
    assert 2 in live_rows and 3 in live_rows  # the greeting ended first (21 tokens): the others went on alone
    # Three sampled rows of one prompt are twins until their tokens differ (rows 0 and 2 agree on "The sea is
    # a" here): each row's text is the one it samples alone.
    hints = []
    twins = decoding._twins
    monkeypatch.setattr(decoding, "_twins", lambda *a: hints.append(twins(*a)) or hints[-1])
    ids = policy.encode(user("Write one short sentence about the sea."))
    rows = [decoding.Row(ids, temperature=0.7, seed=seed) for seed in (1, 2, 3)]
    together = decoding.generate(model, policy.tokenizer, rows, 24, policy.eos_ids, policy.pad_id)
    alone = [decoding.generate(model, policy.tokenizer, [row], 24, policy.eos_ids, policy.pad_id)[0] for row in rows]
    assert [o.text for o in together] == [o.text for o in alone] and len({o.text for o in alone}) == 3
    assert [h.tolist() for h in hints if h is not None][:2] == [[0, 0, 0], [0, 1, 0]]
