"""The decoding KV cache: a `DynamicCache` whose layers grow in place and keep a prefix all rows share once.

Its own module so that the decoding loop (`decoding`) and the lean decode step (`fast_step`) both use it
without importing each other.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that writes into preallocated buffers instead of `torch.cat` per step, and keeps a
    prefix shared by all rows once.

    With a 1,000-token prompt the concatenations copied ~50 MB of fresh memory per step (a quarter
    of the step time); writing in place into a buffer that doubles when full copies only the new
    token. `batch_repeat_interleave` (the shared prompt prefix becoming B rows) does not copy the
    prefix B times: it stays at batch 1 (`shared_keys`, `shared_values`) and each row's own buffer
    starts after it. The model's forward still gets the whole [prefix | own] keys from `update`
    (built once per call: the suffix prefill); the lean decode step reads the two parts apart
    (`append`, then attention over the prefix once for all rows), so a step of K rows reads the
    prefix's keys and values once instead of K times.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._views_stale = False
        super().__init__(**kwargs)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = 0
        self.shared_keys: torch.Tensor | None = None
        """[1, heads, P, dim]: the prefix every row shares (None until a batch repeats a prefix)."""
        self.shared_values: torch.Tensor | None = None

    @property
    def shared_len(self) -> int:
        return 0 if self.shared_keys is None else self.shared_keys.shape[-2]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys and values after the row's own ones; returns the own parts (after any shared prefix)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._len, self._len + key_states.shape[-2]
        if self._k is None or self._v is None or end > self._k.shape[-2]:
            self._grow(key_states, value_states, end)
        assert self._k is not None and self._v is not None
        self._k[..., start:end, :].copy_(key_states)
        self._v[..., start:end, :].copy_(value_states)
        self._len = end
        own_k, own_v = self._k[..., :end, :], self._v[..., :end, :]
        if self.shared_keys is None:
            self.keys, self.values = own_k, own_v
        else:  # views with the whole length, for the cache's bookkeeping (sequence length, masks)
            self.keys = self.shared_keys.expand(own_k.shape[0], -1, -1, -1)
            self.values = self.shared_values.expand(own_v.shape[0], -1, -1, -1)  # type: ignore[union-attr]
        return own_k, own_v

    def wrote(self, end: int) -> None:
        """The native step wrote this layer's new keys and values into the buffers itself, up to `end` (the
        buffers hold that many positions): the bookkeeping `append` would have done, its views made when read."""
        self._len = end
        self._views_stale = self.shared_keys is None

    # `keys` and `values`: as the parent's attributes, except that after `wrote` they are the own buffers' views
    # up to `_len`, made when first read (nothing reads them between decode steps: 60 views a token saved).
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        if self._views_stale:
            self._refresh_views()
        return self._keys

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._settle_views()  # the other view too: setting one of the pair leaves the other current
        self._keys = value

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        if self._views_stale:
            self._refresh_views()
        return self._values

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._settle_views()
        self._values = value

    def _refresh_views(self) -> None:
        assert self._k is not None and self._v is not None
        self._keys, self._values = self._k[..., : self._len, :], self._v[..., : self._len, :]
        self._views_stale = False

    def _settle_views(self) -> None:
        """Before a view is set: make stale views current, or drop them where the buffers are gone (a reset or a
        repeated prefix sets both views next)."""
        if self._views_stale and self._k is not None and self._v is not None:
            self._refresh_views()
        self._views_stale = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        own_k, own_v = self.append(key_states, value_states)
        if self.shared_keys is None or self.shared_values is None:
            return own_k, own_v
        batch = own_k.shape[0]
        self.keys = torch.cat([self.shared_keys.expand(batch, -1, -1, -1), own_k], dim=-2)
        self.values = torch.cat([self.shared_values.expand(batch, -1, -1, -1), own_v], dim=-2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.shared_len + self._len

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = max(256, 2 * needed)
        batch, heads, _, _ = key_states.shape
        k = key_states.new_empty((batch, heads, capacity, key_states.shape[-1]))
        v = value_states.new_empty((batch, heads, capacity, value_states.shape[-1]))
        if self._k is not None and self._v is not None and self._len:
            k[..., : self._len, :] = self._k[..., : self._len, :]
            v[..., : self._len, :] = self._v[..., : self._len, :]
        self._k, self._v = k, v

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.shared_keys is not None:
            raise NotImplementedError("a shared prefix is repeated once")
        if self._k is not None and self._v is not None and self._len:
            # The rows' prefix stays once (batch 1); each row's own keys start empty after it.
            self.shared_keys = self._k[..., : self._len, :]
            self.shared_values = self._v[..., : self._len, :]
            self._k = self._v = None
            self._len = 0
            self.keys = self.shared_keys.expand(repeats, -1, -1, -1)
            self.values = self.shared_values.expand(repeats, -1, -1, -1)

    def reset(self) -> None:
        self._k = self._v = self.shared_keys = self.shared_values = None
        self._len = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the decoding cache is never cropped")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the decoding cache keeps finished rows")


def new_cache(config: Any) -> DynamicCache:
    """A DynamicCache whose full-attention layers grow in place (sliding-window layers stay stock)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
