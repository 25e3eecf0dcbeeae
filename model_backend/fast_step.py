"""A lean decode step for Llama-architecture models: transformers' arithmetic in fewer, fused ops.

One decode step of SmolLM2-135M runs about 500 small tensor ops through transformers' forward: 30 layers
of module calls, decorators, keyword plumbing and output dataclasses, seven small matrix-vector products
per layer, and RMSNorm and rotary embedding as chains of elementwise ops. At batch 1 on a CPU that
overhead costs about as much as reading the weights. This step computes the same function with:

- the q, k and v projections as one matrix product, and gate and up as another (their weights
  concatenated once per set of weights, cached on the model and rebuilt when a weight changes);
- RMSNorm in four ops, rotary embedding applied to q and k together;
- attention called directly: grouped query heads packed onto their key/value heads (no `repeat_kv`),
  and the mask built from the 2-D padding mask (a causal part only when a row feeds several tokens,
  as jump-forward decoding does; one query sees every cached position);
- keys and values written straight into the decoding cache's buffers; where the rows of a batch share
  a prompt prefix (K candidates of one Act prompt, K Rehearse prompts of one history), attention reads
  the prefix's keys and values once for all rows (`shared_prefix_attention`), not once per row.

Its logits match `model(...)`'s to float rounding, not bitwise (the fused products sum in another
order); tests check the difference is tiny and that greedy text is the forward's.

For an fp16 model, steps of at most `NATIVE_STEP_MAX_TOKENS` real tokens go further: `_native_step` runs
each layer as three calls into `native_decode.c` (see `native.py`), or a decode step's layers all in one,
computing only the real tokens of a padded batch (and one of each set of twin rows, `Step`), with a second
copy of the weights in fp16 (`NativeWeights`, built once per set of weights). Bigger steps (prefills, token
trees, scoring passes) multiply by the same copy in C (`native_matmul`), in this step and in transformers'
forward (`NativeLinear`). Where the library cannot be built, or `ENVACE_NATIVE=0`, the torch ops above run
instead.

`decode_step(model, cache)` returns such a step when the model and cache fit (a plain or merged
`LlamaForCausalLM` with SDPA attention, SiLU, a growing cache; its linear layers fp32 or quantized by
`loading.quantize_linears`), else a step that calls `model(...)`: anything else (a PEFT wrapper with an
unmerged adapter, other architectures, forward hooks) decodes as before.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.ao.nn.quantized.dynamic as qd
import torch.nn.functional as F

Step = Callable[..., torch.Tensor]
"""(input ids [B, W], attention mask [B, cache length + W] or None, position ids [B, W], keep=None,
twins=None) -> logits [B, keep or W, V] of the last `keep` positions. W is 1 for a decode step, more where a
grammar forces tokens (jump-forward) or where the rows' own prompt suffixes are encoded after a shared prefix
(`decoding.prefill`). `twins` ([B] long, or None) is a hint: row b, with `twins[b]` != b, is the same sequence
as row `twins[b]` (its prompt, every token so far and this step's), so a step may copy that row's keys, values
and logits instead of computing them (the native step does; the others compute every row)."""


def generic_step(model: Any, cache: Any) -> Step:
    """The ordinary forward call (any model)."""

    def step(ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
             keep: int | None = None, twins: torch.Tensor | None = None) -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                    logits_to_keep=keep or ids.shape[1])
        return out.logits

    return step


Linear = Callable[[torch.Tensor], torch.Tensor]


def native_matmul(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """`h @ weight.T` for an fp16 `weight` [N, K] by `native_decode.c`'s `envace_gemm`, where `h` has more than
    `NATIVE_MAX_TOKENS` rows (prefills, token trees, scoring passes: fewer rows are decode steps, which
    `_native_step` computes whole); None where it does not apply (fewer rows, not fp32 on the CPU, sizes its
    tiles do not take, no library)."""
    from . import native

    rows = h.numel() // h.shape[-1]
    n, k = weight.shape
    if rows <= NATIVE_MAX_TOKENS or h.dtype != torch.float32 or h.device.type != "cpu" or h.shape[-1] != k:
        return None
    lib = native.library()
    if lib is None or n % 16 or k % 8:
        return None
    x = h.contiguous()
    out = x.new_empty((*h.shape[:-1], n))
    lib.envace_gemm(rows, n, k, x.data_ptr(), weight.data_ptr(), out.data_ptr())
    return out


class NativeLinear(qd.Linear):
    """fbgemm's fp16 dynamic linear layer (`loading.quantize_linears` makes these), whose products of more than
    `NATIVE_MAX_TOKENS` rows run natively (`native_matmul`: 1.15-1.4x fbgemm's on the embedded model's
    prefill shapes, 1.5-1.7x on its head) once `NativeWeights.build` has given it its fp16 weight, a view of
    the model's native copy. Any other input, a weight replaced since (`set_weight_bias`), or no library:
    fbgemm, as before."""

    native_weight: "tuple[Any, torch.Tensor] | None" = None
    """(the packed weights it was made from, the fp16 weight [out, in])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self.native_weight
        if held is not None and held[0] is self._packed_params._packed_params:
            out = native_matmul(x, held[1])
            if out is not None:
                return out
        return super().forward(x)


def _linear_types() -> tuple[type, ...]:
    return (torch.nn.Linear, qd.Linear, NativeLinear)  # plain, or `loading.quantize_linears`'s fp16


def _is_fp16_dynamic(module: Any) -> bool:
    return isinstance(module, qd.Linear) and module._packed_params.dtype == torch.float16


def _with_native(weight: torch.Tensor, fallback: Linear) -> Linear:
    """`native_matmul` where it applies, else `fallback` (the fused fbgemm product)."""

    def linear(h: torch.Tensor) -> torch.Tensor:
        out = native_matmul(h, weight)
        return fallback(h) if out is None else out

    return linear


def fused_linear(modules: Sequence[Any]) -> Linear:
    """One function computing `torch.cat([m(h) for m in modules], -1)` as a single matrix product where the
    weights allow it: plain fp32 `nn.Linear`s (weights concatenated) or fbgemm fp16 ones (re-packed).
    Anything else stays separate products, concatenated."""
    if all(type(m) is torch.nn.Linear for m in modules):
        weight = torch.cat([m.weight.detach() for m in modules])
        biases = [m.bias for m in modules]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b.detach() if b is not None else m.weight.new_zeros(m.out_features) for m, b in zip(modules, biases)])
        return lambda h: F.linear(h, weight, bias)
    if all(_is_fp16_dynamic(m) for m in modules):
        parts = [m._packed_params._weight_bias() for m in modules]  # unpacked to fp32
        weight = torch.cat([w for w, _ in parts])
        bias = None if all(b is None for _, b in parts) else torch.cat(
            [b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])
        packed = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        return lambda h: torch.ops.quantized.linear_dynamic_fp16(h, packed)
    if len(modules) == 1:
        return modules[0]
    return lambda h: torch.cat([m(h) for m in modules], dim=-1)


def _has_hooks(model: Any) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def lean_supported(model: Any, cache: Any) -> bool:
    """Whether `lean_step` computes what `model(...)` would for this model and cache."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaRMSNorm

    from .kv_cache import GrowingLayer

    if type(model) is not LlamaForCausalLM or _has_hooks(model):
        return False
    config = model.config
    if config._attn_implementation != "sdpa" or getattr(config, "pretraining_tp", 1) != 1:
        return False
    if (config.rope_parameters or {}).get("rope_type", "default") != "default" or config.hidden_act != "silu":
        return False
    inner = model.model
    if not all(type(layer) is GrowingLayer for layer in cache.layers) or len(cache.layers) != len(inner.layers):
        return False
    linears = _linear_types()
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(type(n) is LlamaRMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return False
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not all(type(m) in linears for m in projections):
            return False
    return type(inner.norm) is LlamaRMSNorm and type(model.lm_head) in linears


ENV = "ENVACE_FAST_STEP"
"""Set to 0 to turn the whole accelerator off (the lean step, the native library, the native fp16 layers): every
step is the ordinary forward and quantized layers are torch's own. `ENVACE_NATIVE=0` turns off the native library
alone."""


def enabled() -> bool:
    """Whether the accelerator is on (`ENVACE_FAST_STEP`, read at each use; on by default)."""
    return os.environ.get(ENV, "1").strip() != "0"


def decode_step(model: Any, cache: Any) -> Step:
    """The accelerator's entry point for the decoder: the lean step where it applies (see `lean_supported`) and
    the accelerator is on (`enabled`), else the ordinary forward."""
    if enabled() and lean_supported(model, cache):
        return lean_step(model, cache)
    return generic_step(model, cache)


class _Same:
    """Equal to another `_Same` of the very same object (packed weights define no `==`)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    __hash__ = None  # type: ignore[assignment]


def _weights_key(model: Any) -> tuple[Any, ...]:
    """Changes whenever a weight is replaced or written in place (a merge, a load, an optimizer step), for a
    model `lean_supported` has checked: its modules are listed by name (walking `model.modules()` and
    `parameters()` took 7 ms, and a step builds several lean steps)."""
    inner = model.model
    modules = [inner.embed_tokens, inner.norm, model.lm_head]
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        modules += [layer.input_layernorm, layer.post_attention_layernorm, attn.q_proj, attn.k_proj, attn.v_proj,
                    attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    key: list[Any] = []
    for module in modules:
        key.append(_Same(module))
        if isinstance(module, qd.Linear):
            # The packed weights themselves (`set_weight_bias` replaces them), held so that their id is not reused.
            key.append(_Same(module._packed_params._packed_params))
        for param in module._parameters.values():
            if param is not None:
                key.append((param.data_ptr(), param._version))
    return tuple(key)


_FUSED: "weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], list[tuple[Linear, Linear]]]]" = \
    weakref.WeakKeyDictionary()


def _fused_layers(model: Any, key: tuple[Any, ...]) -> list[tuple[Linear, Linear]]:
    """Per layer (qkv, gate_up), built once per set of weights (`key`: `_weights_key(model)`)."""
    cached = _FUSED.get(model)
    if cached is None or cached[0] != key:
        layers = [(fused_linear([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]),
                   fused_linear([l.mlp.gate_proj, l.mlp.up_proj])) for l in model.model.layers]
        _FUSED[model] = cached = (key, layers)
    return cached[1]


class NativeWeights:
    """A model's fp16 weights laid out for `native_decode.c`: per layer qkv, o, gate_up, down; the head."""

    def __init__(self, layers: list[tuple[torch.Tensor, ...]], head: torch.Tensor) -> None:
        self.layers = layers
        self.head = head

    @classmethod
    def build(cls, model: Any) -> "NativeWeights | None":
        """Each packed weight unpacked once; None where a linear layer has a bias (the C step adds none). Each
        `NativeLinear` gets its rows of the copy (a view) for its products of many rows."""
        biased = False
        views: list[tuple[Any, Any, torch.Tensor]] = []

        def half(modules: Sequence[Any]) -> torch.Tensor:
            nonlocal biased
            parts = [m._packed_params._weight_bias() for m in modules]
            biased = biased or any(b is not None for _, b in parts)
            weight = torch.cat([w for w, _ in parts]).half().contiguous()
            start = 0
            for module, (w, _) in zip(modules, parts):
                views.append((module, module._packed_params._packed_params, weight[start:start + w.shape[0]]))
                start += w.shape[0]
            return weight

        layers = [(half([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]), half([l.self_attn.o_proj]),
                   half([l.mlp.gate_proj, l.mlp.up_proj]), half([l.mlp.down_proj])) for l in model.model.layers]
        head = half([model.lm_head])
        if biased:
            return None
        for module, packed, view in views:
            if isinstance(module, NativeLinear):
                module.native_weight = (packed, view)
        return cls(layers, head)


_NATIVE: "weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], NativeWeights | None]]" = weakref.WeakKeyDictionary()


def native_supported(model: Any) -> bool:
    """Whether `native_decode.c` can compute this (lean-supported) model's decode step: every linear layer
    fbgemm fp16, sizes its vector loops take, a CPU and a built library (`native.library`). (Biases, which
    only unpacking the weights shows, are refused by `NativeWeights.build`.)"""
    from . import native

    config = model.config
    inner = model.model
    head_dim = inner.layers[0].self_attn.head_dim
    groups = config.num_attention_heads // config.num_key_value_heads
    if model.device.type != "cpu" or config.hidden_size % 16 or config.intermediate_size % 16 or head_dim % 8:
        return False
    if head_dim > 128 or groups > 16 or inner.embed_tokens.weight.dtype != torch.float32:
        return False
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(_is_fp16_dynamic(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                  mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return False
    return _is_fp16_dynamic(model.lm_head) and native.library() is not None


def _native_weights(model: Any, key: tuple[Any, ...] | None = None) -> NativeWeights | None:
    """The model's `NativeWeights`, built once per set of weights (`key`: `_weights_key(model)`, computed here
    when not given); None where the native step does not apply."""
    from . import native

    if native.library() is None:
        return None
    key = _weights_key(model) if key is None else key
    cached = _NATIVE.get(model)
    if cached is None or cached[0] != key:
        _NATIVE[model] = cached = (key, NativeWeights.build(model) if native_supported(model) else None)
    return cached[1]


def prepare_native(model: Any) -> None:
    """Build the model's `NativeWeights` now where they apply, so that its `NativeLinear` layers run their first
    prefill's products natively too (a lean step builds them otherwise, after the first prefill)."""
    from .kv_cache import new_cache

    if enabled() and lean_supported(model, new_cache(model.config)):
        _native_weights(model)


def _plain(module: Any) -> Linear:
    """`module(h)`, minus the module call's overhead for a plain `nn.Linear`."""
    if type(module) is torch.nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda h: F.linear(h, weight, bias)
    return module


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and the log-sum-exp of its scores (what merging two parts of the keys needs).
    A query that sees none of the keys (a pad before a row's first own token) gets zeros and -inf, so the
    merge gives it the other part alone, never NaN (which the pad's cached keys and values would spread)."""
    scores = (q @ k.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - finite) @ v, lse


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`_attention_with_lse` without a mask, by the fused CPU flash-attention kernel (CPU only), which returns the
    log-sum-exp too (measured 1.9x faster than the three products above on 1,000 prefix keys, 2.6x on 300)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scaling)
    return out, lse.unsqueeze(-1)


def shared_prefix_attention(q: torch.Tensor, shared_k: torch.Tensor, shared_v: torch.Tensor, own_k: torch.Tensor,
                            own_v: torch.Tensor, own_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Single-query attention of B rows over [a prefix all rows share | each row's own keys].

    q: [B, kv heads, query heads per kv head, dim]; shared: [1, kv heads, P, dim]; own: [B, kv heads, S, dim].
    The prefix part runs once with all rows' queries stacked (its keys and values read once, not B times),
    the own part per row; the two softmaxes merge exactly through their log-sum-exps (as cascade attention
    does on GPUs).
    """
    batch, kv_heads, groups, dim = q.shape
    stacked = q.transpose(0, 1).reshape(1, kv_heads, batch * groups, dim)
    shared_out, shared_lse = (_flash_with_lse(stacked, shared_k, shared_v, scaling) if q.device.type == "cpu"
                              else _attention_with_lse(stacked, shared_k, shared_v, None, scaling))
    shared_out = shared_out.reshape(kv_heads, batch, groups, dim).transpose(0, 1)
    shared_lse = shared_lse.reshape(kv_heads, batch, groups, 1).transpose(0, 1)
    own_out, own_lse = _attention_with_lse(q, own_k, own_v, own_mask, scaling)
    lse = torch.logaddexp(shared_lse, own_lse)
    return shared_out * torch.exp(shared_lse - lse) + own_out * torch.exp(own_lse - lse)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm's formula for fp32 activations (F.rms_norm's CPU kernel is slower at one row).
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def lean_step(model: Any, cache: Any, native_enabled: bool = True) -> Step:
    """The decode step of a `LlamaForCausalLM`, as fused tensor ops (see the module docstring); steps of at most
    `NATIVE_STEP_MAX_TOKENS` real tokens of an fp16 model run natively (`_native_step`) where `native_enabled` and
    the library is built (token trees never do), and so do the products of bigger steps (`native_matmul`;
    those of the model's own `NativeLinear` layers follow `native.use` alone)."""
    config = model.config
    inner = model.model
    embed = inner.embed_tokens
    rotary = inner.rotary_emb
    attn0 = inner.layers[0].self_attn
    head_dim, scaling = attn0.head_dim, attn0.scaling
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    groups = n_heads // n_kv
    q_size, kv_size = n_heads * head_dim, n_kv * head_dim
    mlp_size = config.intermediate_size
    key = _weights_key(model)  # once for both weight caches below
    native_weights = _native_weights(model, key) if native_enabled else None
    native_step = None if native_weights is None else _native_step(model, cache, native_weights)
    fused = _fused_layers(model, key)
    if native_weights is not None:  # the fused products of many rows run natively too
        fused = [(_with_native(w[0], qkv), _with_native(w[2], gate_up))
                 for w, (qkv, gate_up) in zip(native_weights.layers, fused)]
    layers = []
    for layer, (qkv, gate_up), cache_layer in zip(inner.layers, fused, cache.layers):
        layers.append((layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon, qkv,
                       _plain(layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
                       layer.post_attention_layernorm.variance_epsilon, gate_up, _plain(layer.mlp.down_proj),
                       cache_layer))
    norm_w, norm_eps = inner.norm.weight, inner.norm.variance_epsilon
    lm_head = _plain(model.lm_head)

    def step(ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
             keep: int | None = None, tree: torch.Tensor | None = None,
             twins: torch.Tensor | None = None, at: torch.Tensor | None = None) -> torch.Tensor:
        """`tree` ([W, W] bool, batch 1, no `mask`): which of the W new tokens each new one sees (a token tree:
        itself and its ancestors), instead of all earlier ones; every cached position stays visible. `at`
        ([n] long, with a tree): the new positions whose logits to return ([B, n, V]), instead of the last
        `keep`."""
        batch, width = ids.shape
        if native_step is not None and tree is None and at is None:
            logits = native_step(ids, mask, positions, keep, twins)
            if logits is not None:
                return logits
        x = F.embedding(ids, embed.weight, embed.padding_idx)  # [B, W, hidden]
        cos, sin = rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        own_mask: torch.Tensor | None = None
        for in_w, in_eps, qkv, o_proj, post_w, post_eps, gate_up, down_proj, cache_layer in layers:
            h = _rms_norm(x, in_w, in_eps)
            fused = qkv(h)
            qk = fused[..., : q_size + kv_size].view(batch, width, n_heads + n_kv, head_dim).transpose(1, 2)
            half = head_dim // 2
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            # Query heads packed onto their key/value head: [B, kv heads, groups * W, dim].
            q = qk[:, :n_heads].reshape(batch, n_kv, groups * width, head_dim)
            k = qk[:, n_heads:]
            v = fused[..., q_size + kv_size:].view(batch, width, n_kv, head_dim).transpose(1, 2)
            k, v = cache_layer.append(k, v)
            if own_mask is None and tree is not None:
                seen = torch.cat([tree.new_ones((width, k.shape[-2] - width)), tree], dim=1)
                seen = seen.repeat(groups, 1)[None, None]  # rows in (group, position) order, as q is packed
                # Additive, made once: attention converts a boolean mask to this in every layer otherwise.
                own_mask = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
            elif own_mask is None and (mask is not None or width > 1):  # the same for every layer
                own_mask = _own_mask(mask, cache_layer.shared_len, k.shape[-2], width, groups)
            if cache_layer.shared_keys is None:
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=own_mask, scale=scaling)
            else:
                a = shared_prefix_attention(q, cache_layer.shared_keys, cache_layer.shared_values, k, v, own_mask,
                                            scaling)
            a = a.reshape(batch, n_heads, width, head_dim).transpose(1, 2).reshape(batch, width, q_size)
            x = x + o_proj(a)
            h = _rms_norm(x, post_w, post_eps)
            gate, up = gate_up(h).split(mlp_size, dim=-1)
            x = x + down_proj(F.silu(gate) * up)
        if at is not None:
            x = x[:, at]
        elif keep is not None and keep < width:
            x = x[:, -keep:]
        x = _rms_norm(x, norm_w, norm_eps)
        return lm_head(x)

    return step


NATIVE_MAX_TOKENS = 16
"""Products of more rows than this run as `envace_gemm`'s packed product (`native_matmul`); fewer are decode
steps, which `_native_step` computes whole."""
NATIVE_STEP_MAX_TOKENS = 64
"""Steps computing at most this many new tokens in all (a row's twins and pads not counted) run natively; bigger
ones (prefills, token trees) go through torch with the same native products. 36 tokens (four rows of nine)
took 119 ms natively against 140 through torch, 60 tokens (20 rows of three) 188 against 206."""


def _native_step(model: Any, cache: Any, weights: NativeWeights) -> Callable[..., torch.Tensor | None]:
    """New tokens through `native_decode.c`: three C calls a layer (before attention, attention over [shared
    prefix | the row's own keys], after attention) and one for the head. Only real tokens are computed: a
    batch's pads (rows feeding fewer tokens than the widest, as jump-forward's do, and finished rows, whose new
    token `decoding.generate` masks) cost nothing, and their
    keys and values go into the cache as zeros, masked like any pad's. Keys and values go into the cache
    through `append`, so the cache's bookkeeping is the torch step's, except in a decode step with every row
    live, whose layers run in one C call that writes them into the cache's buffers (`all_layers`; then
    `GrowingLayer.wrote`). Returns None for a step it leaves to torch (more than `NATIVE_STEP_MAX_TOKENS`
    tokens to compute)."""
    from . import native

    lib = native.library()
    assert lib is not None
    config = model.config
    inner = model.model
    attn0 = inner.layers[0].self_attn
    dim, scaling = attn0.head_dim, float(attn0.scaling)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    groups, hidden, mlp = heads // kv, config.hidden_size, config.intermediate_size
    vocab = weights.head.shape[0]
    embed, rotary = inner.embed_tokens, inner.rotary_emb
    layers = [(layer.input_layernorm.weight.detach(), float(layer.input_layernorm.variance_epsilon), qkv, o,
               layer.post_attention_layernorm.weight.detach(), float(layer.post_attention_layernorm.variance_epsilon),
               gate_up, down, cache_layer)
              for layer, (qkv, o, gate_up, down), cache_layer in zip(inner.layers, weights.layers, cache.layers)]
    norm_w, norm_eps = inner.norm.weight.detach(), float(inner.norm.variance_epsilon)
    scratch_size = max(hidden + (heads + 2 * kv) * dim, hidden + 2 * mlp)
    caches = [entry[8] for entry in layers]
    weight_ptrs = [[t.data_ptr() for t in (in_w, qkv, o, post_w, gate_up, down)]
                   for in_w, _, qkv, o, post_w, _, gate_up, down, _ in layers]
    layer_eps = torch.tensor([[entry[1], entry[5]] for entry in layers], dtype=torch.float32)
    held: list[Any] = []  # the cache tensors `tables` point into, while they stay the same tensors
    tables: list[Any] = []

    def all_layers(batch: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                   scratch_tensors: tuple[torch.Tensor, ...]) -> bool:
        """A decode step with every row live through all layers in one C call (`envace_decode_layers`), keys
        and values written into the cache's buffers in place. False (nothing done) where a buffer must grow
        first or the layers' buffers differ in shape: the per-layer calls below then run, appending."""
        first = caches[0]
        pos, buffer = first._len, first._k
        if buffer is None or buffer.shape[0] != batch or pos + 1 > buffer.shape[-2]:
            return False
        shared_len = first.shared_len
        buffers = [t for layer in caches for t in (layer._k, layer._v, layer.shared_keys, layer.shared_values)]
        if len(held) != len(buffers) or any(a is not b for a, b in zip(held, buffers)):  # new buffers: check them
            shape = buffer.shape
            if any(layer._k is None or layer._v is None or layer._k.shape != shape or layer._v.shape != shape
                   or layer.shared_len != shared_len for layer in caches):
                return False
            prefixes = [(layer.shared_keys, layer.shared_values) for layer in caches] if shared_len else []
            shared_hs = prefixes[0][0].stride(1) if prefixes else 0  # type: ignore[union-attr]
            if any(pk.stride(1) != shared_hs for pk, _ in prefixes):  # type: ignore[union-attr]
                return False
            ptrs = [p for w, layer in zip(weight_ptrs, caches) for p in (*w, layer._k.data_ptr(), layer._v.data_ptr())]
            shared = [t.data_ptr() for pair in prefixes for t in pair]  # type: ignore[union-attr]
            tables[:] = [torch.tensor(ptrs, dtype=torch.int64), torch.tensor(shared or [0], dtype=torch.int64),
                         shared_hs]
            held[:] = buffers
        if any(layer._len != pos for layer in caches):
            return False
        ptr_table, shared_table, shared_hs = tables
        own_mask = None if mask is None else mask[:, shared_len:].to(torch.uint8).contiguous()
        q, k, v, a, scratch = scratch_tensors
        lib.envace_decode_layers(len(caches), batch, hidden, heads, kv, dim, mlp, x.data_ptr(), cos.data_ptr(),
                                 sin.data_ptr(), ptr_table.data_ptr(), layer_eps.data_ptr(), shared_table.data_ptr(),
                                 shared_hs, shared_len, buffer.stride(0), buffer.stride(1), pos,
                                 None if own_mask is None else own_mask.data_ptr(), scaling, q.data_ptr(),
                                 k.data_ptr(), v.data_ptr(), a.data_ptr(), scratch.data_ptr())
        for layer in caches:
            layer.wrote(pos + 1)
        return True

    def step(ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor,
             keep: int | None = None, twins: torch.Tensor | None = None) -> torch.Tensor | None:
        batch, width = ids.shape
        copies = None  # rows that copy their twin's keys, values and logits
        if twins is not None:
            copies = (twins != torch.arange(batch)).nonzero().squeeze(1)
            copies = copies if copies.numel() else None
        if copies is None and width == 1 and (mask is None or bool(mask[:, -1].all())):
            real, count = None, batch  # a decode step: every row feeds a token
            tokens, token_positions = ids.reshape(batch), positions.reshape(batch)
        else:
            new = (mask[:, -width:] != 0) if mask is not None else ids.new_ones((batch, width), dtype=torch.bool)
            if copies is not None:
                new[copies] = False
            real = new.reshape(-1).nonzero().squeeze(1)  # flat (row, position) indices of the tokens computed
            count = real.numel()
            if count == 0 or count > NATIVE_STEP_MAX_TOKENS:
                return None
            tokens, token_positions = ids.reshape(-1)[real], positions.reshape(-1)[real]
        x = F.embedding(tokens, embed.weight, embed.padding_idx).contiguous()  # [N, hidden]
        cos, sin = rotary(x[:, None], token_positions[:, None])
        cos, sin = cos.reshape(count, dim).contiguous(), sin.reshape(count, dim).contiguous()
        q = x.new_empty((count, heads, dim))
        k, v = x.new_empty((count, kv, dim)), x.new_empty((count, kv, dim))
        a = x.new_empty((count, heads * dim))
        scratch = x.new_empty((count * scratch_size,))
        if real is None:
            k_rows, v_rows = k.view(batch, kv, 1, dim), v.view(batch, kv, 1, dim)
            row_of = limit = None
        else:
            k_all, v_all = x.new_zeros((batch * width, kv, dim)), x.new_zeros((batch * width, kv, dim))
            k_rows = k_all.view(batch, width, kv, dim).transpose(1, 2)
            v_rows = v_all.view(batch, width, kv, dim).transpose(1, 2)
            row_of, limit = (real // width).to(torch.int32), None
            offset = (real % width).to(torch.int32)  # a token sees its row's own keys up to itself
        own_mask = None
        done = real is None and all_layers(batch, x, cos, sin, mask, (q, k, v, a, scratch))
        for in_w, in_eps, qkv, o, post_w, post_eps, gate_up, down, cache_layer in [] if done else layers:
            lib.envace_pre_attention(count, hidden, heads, kv, dim, x.data_ptr(), in_w.data_ptr(), in_eps,
                                     qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
                                     v.data_ptr(), scratch.data_ptr())
            if real is not None:
                k_all[real], v_all[real] = k, v
                if copies is not None:
                    k_by_row, v_by_row = k_all.view(batch, width, kv, dim), v_all.view(batch, width, kv, dim)
                    k_by_row[copies], v_by_row[copies] = k_by_row[twins[copies]], v_by_row[twins[copies]]
            own_k, own_v = cache_layer.append(k_rows, v_rows)
            own = own_k.shape[-2]
            shared_len = cache_layer.shared_len
            if own_mask is None and mask is not None:
                own_mask = mask[:, shared_len:].to(torch.uint8).contiguous()
            if real is not None and limit is None:
                limit = (offset + (own - width + 1)).to(torch.int32)
            if shared_len:
                shared_k, shared_v = cache_layer.shared_keys, cache_layer.shared_values
                shared = (shared_k.data_ptr(), shared_v.data_ptr(), shared_k.stride(1))
            else:
                shared = (None, None, 0)
            lib.envace_attention(count, kv, groups, dim, q.data_ptr(), *shared, shared_len, own_k.data_ptr(),
                                 own_v.data_ptr(), own_k.stride(0), own_k.stride(1), own,
                                 None if own_mask is None else own_mask.data_ptr(),
                                 None if row_of is None else row_of.data_ptr(),
                                 None if limit is None else limit.data_ptr(), scaling, a.data_ptr())
            lib.envace_post_attention(count, hidden, mlp, x.data_ptr(), a.data_ptr(), o.data_ptr(), post_w.data_ptr(),
                                      post_eps, gate_up.data_ptr(), down.data_ptr(), scratch.data_ptr())
        if real is None:
            logits = x.new_empty((batch, vocab))
            lib.envace_head(batch, hidden, vocab, x.data_ptr(), norm_w.data_ptr(), norm_eps, weights.head.data_ptr(),
                            logits.data_ptr(), scratch.data_ptr())
            return logits[:, None]
        kept = keep if keep is not None and keep < width else width
        wanted = (real % width) >= width - kept  # the last `kept` positions of each row (pads get zeros)
        rows_x = x[wanted].contiguous()
        head_out = x.new_empty((rows_x.shape[0], vocab))
        lib.envace_head(rows_x.shape[0], hidden, vocab, rows_x.data_ptr(), norm_w.data_ptr(), norm_eps,
                        weights.head.data_ptr(), head_out.data_ptr(), scratch.data_ptr())
        logits = x.new_zeros((batch * kept, vocab))
        chosen = real[wanted]
        logits[(chosen // width) * kept + (chosen % width) - (width - kept)] = head_out
        logits = logits.view(batch, kept, vocab)
        if copies is not None:
            logits[copies] = logits[twins[copies]]
        return logits

    return step


def _own_mask(mask: torch.Tensor | None, shared: int, own: int, width: int, groups: int) -> torch.Tensor:
    """[B or 1, 1, groups * W, own]: which of a row's own cached positions each of the W new queries sees:
    not the pads (`mask`, [B, shared + own]), and causally only up to itself (the last W are the new ones)."""
    seen = torch.ones((1, 1, 1, own), dtype=torch.bool) if mask is None else mask[:, shared:].bool()[:, None, None, :]
    if width == 1:
        return seen
    last = torch.arange(own - width, own, device=seen.device)[:, None]  # each new query's own position
    causal = torch.arange(own, device=seen.device)[None, :] <= last  # [W, own]
    return seen & causal.repeat(groups, 1)[None, None]  # rows in (group, position) order, as q is packed
