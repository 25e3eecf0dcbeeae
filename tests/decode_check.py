"""Shared by the decode-step tests (the lean torch step, the native C step): a prompt, greedy decode logits
through one step function, and the check that two step functions compute the same thing."""
from __future__ import annotations

from typing import Any

import torch

from model_backend import Prompt
from model_backend import decoding


def user(text: str, prefill: str = "") -> Prompt:
    return Prompt([{"role": "system", "content": "You are a file system API. Reply briefly."},
                   {"role": "user", "content": text}], prefill=prefill)


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
            logits = step(tokens[:, None], mask if pre.has_padding else None, positions[:, None])[:, -1]
            positions = positions + 1
            out.append(logits.clone())
            tokens = logits.argmax(-1)
    return torch.stack(out)


def assert_same_function(lean: torch.Tensor, forward: torch.Tensor) -> None:
    """Float rounding apart (fused products sum in another order), the same logits and greedy tokens."""
    assert (lean - forward).abs().max().item() < 1e-3
    assert torch.equal(lean.argmax(-1), forward.argmax(-1))
