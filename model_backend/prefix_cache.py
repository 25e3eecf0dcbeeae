"""Cross-step prefix cache: the KV of recent prompt prefixes, reused by the next prompt that starts the same way.

An episode's prompts grow step by step: step n+1's Act prompt is step n's plus the committed call
and its result, and Rehearse prompts share the tool text and the history. Re-encoding all of it
each step is most of a step's prefill. Like vLLM's automatic prefix caching and SGLang's radix
cache (on GPU), `decoding.prefill` asks this cache for the longest stored token prefix of its
shared prefix, copies that much KV into the new cache, and runs only the tokens after it.

Entries are keyed by their token ids only, so a hit is exact by construction: a prefix's keys and
values depend on nothing after it (causal attention). The cache belongs to one loaded model (a
`TransformersPolicy`), so a model change drops it; `clear()` drops it on an episode reset. It is
bounded by bytes and evicts the least recently used entry; an entry that is a prefix of a newer
one is dropped at once, since the newer one serves every lookup the older would.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

import torch

DEFAULT_MAX_BYTES = 512 * 2**20
"""SmolLM2-135M keeps 46 KB of fp32 KV per token: 512 MiB hold about 11,000 prompt tokens."""
MIN_TOKENS = 16
"""Shorter prefixes are not worth storing (or restoring)."""


@dataclass
class _Entry:
    ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int


@dataclass
class CacheStats:
    """What the cache saved so far: prompt tokens restored vs computed by prefills that asked it."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    ta, tb = torch.as_tensor(a[:n]), torch.as_tensor(b[:n])
    differ = (ta != tb).nonzero()
    return int(differ[0, 0]) if len(differ) else n


class PrefixCache:
    """An LRU of prompt-prefix KV caches, bounded by `max_bytes` (thread-safe)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, min_tokens: int = MIN_TOKENS) -> None:
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def restore(self, ids: Sequence[int], cache: Any) -> int:
        """Write the KV of the longest stored prefix of `ids` into the empty `cache`; the number of
        positions written (0 on a miss). At least one token of `ids` is always left to compute."""
        with self._lock:
            self.stats.lookups += 1
            best, best_len = None, 0
            for entry in self._entries.values():
                n = _common_len(entry.ids, ids)
                if n > best_len:
                    best, best_len = entry, n
            best_len = min(best_len, len(ids) - 1)
            if best is None or best_len < self.min_tokens:
                self.stats.computed_tokens += len(ids)
                return 0
            self._entries.move_to_end(best.ids)
            for layer, (k, v) in enumerate(zip(best.keys, best.values)):
                cache.update(k[..., :best_len, :], v[..., :best_len, :], layer)  # copied into the new cache
            self.stats.hits += 1
            self.stats.reused_tokens += best_len
            self.stats.computed_tokens += len(ids) - best_len
            return best_len

    def lookup(self, ids: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Per-layer keys and values ([1, heads, len(ids), dim] views, not copies) of a stored entry that holds
        all of `ids`; None when none does. Counted as a lookup, and as a hit that reused every token."""
        with self._lock:
            self.stats.lookups += 1
            n = len(ids)
            if n < self.min_tokens:
                return None
            entry = next((e for e in self._entries.values() if len(e.ids) >= n and _common_len(e.ids, ids) == n), None)
            if entry is None:
                return None
            self._entries.move_to_end(entry.ids)
            self.stats.hits += 1
            self.stats.reused_tokens += n
            return [k[..., :n, :] for k in entry.keys], [v[..., :n, :] for v in entry.values]

    def covered(self, ids: Sequence[int]) -> int:
        """How many leading tokens of `ids` a stored entry holds (a lookup that changes nothing)."""
        with self._lock:
            return max((_common_len(entry.ids, ids) for entry in self._entries.values()), default=0)

    def store(self, ids: Sequence[int], cache: Any) -> None:
        """Keep a copy of the first `len(ids)` positions of `cache` (batch 1) under `ids`."""
        n = len(ids)
        if n < self.min_tokens:
            return
        self.store_tensors(ids, [layer.keys[..., :n, :].clone() for layer in cache.layers],
                           [layer.values[..., :n, :].clone() for layer in cache.layers])

    def store_tensors(self, ids: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Keep per-layer keys and values ([1, heads, len(ids), dim], owned by the cache from now on) under `ids`."""
        n = len(ids)
        if n < self.min_tokens:
            return
        nbytes = sum(t.numel() * t.element_size() for t in keys + values)
        if nbytes > self.max_bytes:
            return
        key = tuple(ids)
        with self._lock:
            for old in [k for k in self._entries if len(k) <= n and _common_len(k, key) == len(k)]:
                del self._entries[old]  # a prefix of the new entry: the new one serves its lookups
            self._entries[key] = _Entry(key, keys, values, nbytes)
            while self.nbytes > self.max_bytes:
                self._entries.popitem(last=False)
