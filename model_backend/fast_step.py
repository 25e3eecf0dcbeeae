"""A lean decode step for Llama-architecture models: the same arithmetic as transformers' forward, less Python.

One decode step of SmolLM2-135M runs about 500 small tensor ops; transformers wraps them in 30 layers of
module calls, decorators, keyword plumbing and output dataclasses, which cost about as much as the
arithmetic itself at batch 1 on a CPU. This step calls the same kernels on the same weights in the same
order (the model's own RMSNorm formula, rotary embedding, causal mask and SDPA attention function), so
its logits are bitwise those of `model(...)` (tested), and writes keys and values straight into the
decoding cache's buffers.

`decode_step(model, cache)` returns such a step when the model and cache fit (a plain or merged
`LlamaForCausalLM` with SDPA attention and a growing cache; its linear layers fp32 or quantized by
`loading.quantize_linears`), else a step that calls `model(...)`:
anything else (a PEFT wrapper with an unmerged adapter, other architectures, forward hooks) decodes
as before.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

Step = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]
"""(input ids [B, 1], attention mask [B, cache length + 1] or None, position ids [B, 1]) -> logits [B, V]."""


def generic_step(model: Any, cache: Any) -> Step:
    """The ordinary forward call (any model)."""

    def step(ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                    logits_to_keep=1)
        return out.logits[:, -1, :]

    return step


def _linear_types() -> tuple[type, ...]:
    import torch.ao.nn.quantized.dynamic as qd

    return (torch.nn.Linear, qd.Linear)  # plain, or `loading.quantize_linears`'s fp16/int8


def _linear(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module(h)`, minus the module call's overhead for a plain `nn.Linear`."""
    if type(module) is torch.nn.Linear:
        weight, bias = module.weight, module.bias
        return lambda h: F.linear(h, weight, bias)
    return module


def _has_hooks(model: Any) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def lean_supported(model: Any, cache: Any) -> bool:
    """Whether `lean_step` computes exactly what `model(...)` would for this model and cache."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaRMSNorm

    from .decoding import _GrowingLayer

    if type(model) is not LlamaForCausalLM or _has_hooks(model):
        return False
    config = model.config
    if config._attn_implementation != "sdpa" or getattr(config, "pretraining_tp", 1) != 1:
        return False
    if (config.rope_parameters or {}).get("rope_type", "default") != "default":
        return False
    inner = model.model
    if not all(type(layer) is _GrowingLayer for layer in cache.layers) or len(cache.layers) != len(inner.layers):
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


def decode_step(model: Any, cache: Any) -> Step:
    """The lean step where it is exact (see `lean_supported`), else the ordinary forward."""
    return lean_step(model, cache) if lean_supported(model, cache) else generic_step(model, cache)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm.forward, op for op (the same rounding).
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def lean_step(model: Any, cache: Any) -> Step:
    """The decode step of a `LlamaForCausalLM`, as plain tensor ops (see the module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask

    config = model.config
    inner = model.model
    embed = inner.embed_tokens
    rotary = inner.rotary_emb
    head_dim = inner.layers[0].self_attn.head_dim
    # Per layer: the weights, read once here; the tensors are the model's own (no copies).
    layers = []
    for layer, cache_layer in zip(inner.layers, cache.layers):
        attn, mlp = layer.self_attn, layer.mlp
        layers.append((
            layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
            attn, _linear(attn.q_proj), _linear(attn.k_proj), _linear(attn.v_proj), _linear(attn.o_proj),
            layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
            _linear(mlp.gate_proj), _linear(mlp.up_proj), _linear(mlp.down_proj), mlp.act_fn, cache_layer,
        ))
    norm_w, norm_eps = inner.norm.weight, inner.norm.variance_epsilon
    lm_head = _linear(model.lm_head)

    def step(ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, embed.weight, embed.padding_idx)
        causal = create_causal_mask(config=config, inputs_embeds=x, attention_mask=mask, cache=cache,
                                    position_ids=positions)
        cos, sin = rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        batch = x.shape[0]
        shape = (batch, 1, -1, head_dim)
        for (in_w, in_eps, attn, q_proj, k_proj, v_proj, o_proj, post_w, post_eps,
             gate_proj, up_proj, down_proj, act_fn, cache_layer) in layers:
            h = _rms_norm(x, in_w, in_eps)
            q = q_proj(h).view(shape).transpose(1, 2)
            k = k_proj(h).view(shape).transpose(1, 2)
            v = v_proj(h).view(shape).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache_layer.update(k, v)
            a, _ = sdpa_attention_forward(attn, q, k, v, causal, dropout=0.0, scaling=attn.scaling)
            a = a.reshape(batch, 1, -1).contiguous()
            x = x + o_proj(a)
            h = _rms_norm(x, post_w, post_eps)
            x = x + down_proj(act_fn(gate_proj(h)) * up_proj(h))
        x = _rms_norm(x, norm_w, norm_eps)
        return lm_head(x[:, -1, :])

    return step
