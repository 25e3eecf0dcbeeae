"""Batched decoding over a shared prompt prefix, with per-row sampling and stop strings.

The prefix common to all rows runs once at batch 1; its KV cache is then copied to batch B and
only the differing suffixes run batched. Suffixes are left-padded *after* the prefix, so the
cache reads [prefix | pad | suffix]; the attention mask hides the pads and explicit position ids
number each row's real tokens contiguously, so a row computes what it would compute alone.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from .base import Timings
from .constrain import mask_logits
from .fast_step import decode_step, generic_step, lean_step, lean_supported
from .kv_cache import GrowingLayer, new_cache
from .prefix_cache import PrefixCache


@dataclass
class Row:
    """One sequence to continue."""

    ids: list[int]
    """Prompt token ids (chat template + prefill)."""
    temperature: float = 0.0
    """0 means greedy."""
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    matcher: Any = None
    """Grammar state (`constrain.RowMatcher`): only the tokens it allows are chosen. None: free."""


@dataclass
class RowOutput:
    token_ids: list[int] = field(default_factory=list)
    """Generated ids, EOS excluded."""
    token_logprobs: list[float] = field(default_factory=list)
    """One per generated token, EOS included (it ends the sequence, so it is part of its probability)."""
    text: str = ""
    """Decoded generated text, cut just after the first stop string."""
    finished: bool = False


@dataclass
class Prefilled:
    cache: DynamicCache
    logits: torch.Tensor
    """[B, keep, V]: logits of the last `keep` positions of each row (rows are right-aligned)."""
    attention_mask: torch.Tensor
    """[B, cache length]: 0 over the pads between prefix and suffix."""
    next_positions: torch.Tensor
    """[B]: the position id of each row's next token."""
    has_padding: bool
    prefix_len: int


LEAN_PREFILL_WIDTH = 16
"""Suffixes up to this many tokens are prefilled through the lean step (cascade attention)."""


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for i in range(n):
        tok = first[i]
        if any(s[i] != tok for s in seqs[1:]):
            return i
    return n


def prefill(
    model: Any, seqs: Sequence[Sequence[int]], min_suffix: Sequence[int], keep: int, pad_id: int,
    prefix_cache: PrefixCache | None = None, rows_cache: PrefixCache | None = None,
    rows_stored: Sequence[int] | None = None,
) -> Prefilled:
    """Run the shared prefix once, then the suffixes batched; `min_suffix[i]` tokens of row i stay in the suffix.
    With a `prefix_cache`, the shared prefix starts from the longest stored prefix of it, and is stored; so is
    each row of a batch (its first `rows_stored[i]` tokens, default all) in `rows_cache` (default `prefix_cache`)."""
    device = model.device
    batch = len(seqs)
    prefix_len = min(common_prefix_len(seqs), *(len(s) - m for s, m in zip(seqs, min_suffix)))
    prefix_len = max(prefix_len, 0)
    cache = new_cache(model.config)
    if any(type(layer) is not GrowingLayer for layer in cache.layers):
        prefix_cache = rows_cache = None  # a sliding-window layer's cache cannot be cut at a position
    if prefix_len > 0:
        encode_prefix(model, list(seqs[0][:prefix_len]), cache, prefix_cache)
    suffixes = [list(s[prefix_len:]) for s in seqs]
    width = max(len(s) for s in suffixes)
    tree = None
    if batch > 1 and keep == 1 and prefix_len > 0 and lean_supported(model, cache):
        tree = TokenTree(suffixes)
        if len(tree.tokens) - 1 > min(TREE_SHARE * batch * width, TREE_MAX_NODES):
            tree = None
    tree_logits = _encode_tree(model, cache, tree, prefix_len, suffixes) if tree is not None else None
    if prefix_len > 0 and batch > 1:
        cache.batch_repeat_interleave(batch)

    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, prefix_len + width), dtype=torch.long)
    mask[:, :prefix_len] = 1
    # Pads get the position of the row's first real suffix token; they are masked anyway.
    positions = torch.full((batch, width), prefix_len, dtype=torch.long)
    for i, suffix in enumerate(suffixes):
        n = len(suffix)
        input_ids[i, width - n :] = torch.tensor(suffix, dtype=torch.long)
        mask[i, prefix_len + width - n :] = 1
        positions[i, width - n :] = torch.arange(prefix_len, prefix_len + n)
    has_padding = bool((mask == 0).any())
    if tree is not None and tree_logits is not None:
        logits = _tree_rows(cache, tree, tree_logits, suffixes, width)
    else:
        # Short rows after a shared prefix (tool names to rank): the lean step's cascade attention reads the
        # prefix's keys once for all rows, where the forward builds B copies of them in every layer. Long
        # suffixes stay with the forward's fused attention, which measured faster there.
        lean = prefix_len > 0 and batch > 1 and width <= LEAN_PREFILL_WIDTH
        forward = decode_step(model, cache) if lean else generic_step(model, cache)
        logits = forward(input_ids.to(device), mask.to(device) if has_padding else None, positions.to(device), keep)
    rows_cache = rows_cache if rows_cache is not None else prefix_cache
    if rows_cache is not None and batch > 1:
        _store_rows(rows_cache, [list(s[:n]) for s, n in zip(seqs, rows_stored or [len(s) for s in seqs])],
                    [len(s) for s in seqs], prefix_len, width, cache)
    next_positions = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=device)
    return Prefilled(cache, logits, mask.to(device), next_positions, has_padding, prefix_len)


TREE_SHARE = 0.8
"""`prefill` encodes the rows' suffixes as one token tree when its nodes are at most this share of the batch's
padded positions (K Rehearse prompts of calls to one tool share its description; K Act rows, their prompt)."""
TREE_MAX_NODES = 2048


def _encode_tree(model: Any, cache: DynamicCache, tree: TokenTree, prefix_len: int,
                 suffixes: list[list[int]]) -> tuple[torch.Tensor, list]:
    """The suffixes' token tree in one row after the prefix (batch 1, tree attention). Returns the logits of
    each suffix's last token ([B, V]: the head, a fifth of the model's products, runs for these nodes only)
    and, per layer, the nodes' keys and values; the cache is cut back to the prefix."""
    ids = torch.tensor([tree.tokens[1:]], device=model.device)
    positions = torch.tensor([[prefix_len + d - 1 for d in tree.depths[1:]]], device=model.device)
    seen = tree.ancestry()[1:, 1:].to(model.device)
    ends = torch.tensor([tree.path(s)[-1] - 1 for s in suffixes], device=model.device)
    logits = lean_step(model, cache)(ids, None, positions, tree=seen, at=ends)[0]
    nodes = []
    for layer in cache.layers:
        nodes.append((layer._k[..., prefix_len:layer._len, :].clone(), layer._v[..., prefix_len:layer._len, :].clone()))
        layer._len = prefix_len
        layer.keys, layer.values = layer._k[..., :prefix_len, :], layer._v[..., :prefix_len, :]
    return logits, nodes


def _tree_rows(cache: DynamicCache, tree: TokenTree, encoded: tuple[torch.Tensor, list], suffixes: list[list[int]],
               width: int) -> torch.Tensor:
    """Each row's own keys and values gathered from its path through the tree, right-aligned in `width` (pads
    left, masked), after the shared prefix; returns the logits of each row's last token ([B, 1, V]), which
    `_encode_tree` computed."""
    logits, nodes = encoded
    pad = len(tree.tokens) - 1  # index of a zero slot after the nodes
    index = torch.full((len(suffixes), width), pad, dtype=torch.long)
    for i, suffix in enumerate(suffixes):
        index[i, width - len(suffix):] = torch.tensor(tree.path(suffix)) - 1
    index = index.to(logits.device)
    for layer, (keys, values) in zip(cache.layers, nodes):
        keys = torch.cat([keys, keys.new_zeros(keys[..., :1, :].shape)], dim=-2)[0]  # [heads, N + 1, dim]
        values = torch.cat([values, values.new_zeros(values[..., :1, :].shape)], dim=-2)[0]
        layer.append(keys[:, index].transpose(0, 1), values[:, index].transpose(0, 1))  # [B, heads, width, dim]
    return logits[:, None, :]


def encode_prefix(model: Any, prefix_ids: list[int], cache: DynamicCache, prefix_cache: PrefixCache | None) -> None:
    """Fill the empty `cache` (batch 1) with `prefix_ids`: from the longest stored prefix of them, the rest
    computed, and the whole stored when no entry holds it yet."""
    reused = prefix_cache.restore(prefix_ids, cache) if prefix_cache is not None else 0
    prefix = torch.tensor([prefix_ids[reused:]], device=model.device)
    # The lean step where it applies: a short rest after a restored prefix (an Act prompt and the ranking's
    # `<tool_call>{"name": "`) then runs natively, 53 ms against the forward's 95 for 901 restored + 9 tokens.
    positions = torch.arange(reused, len(prefix_ids), device=model.device)[None]
    decode_step(model, cache)(prefix, None, positions, 1)
    if prefix_cache is not None and prefix_cache.covered(prefix_ids) < len(prefix_ids):
        prefix_cache.store(prefix_ids, cache)


def _store_rows(prefix_cache: PrefixCache, seqs: Sequence[Sequence[int]], lengths: Sequence[int], prefix_len: int,
                width: int, cache: DynamicCache) -> None:
    """Keep each row's prompt (shared prefix + its own suffix; `seqs[i]` is the first part of the `lengths[i]`
    tokens row i fed) where the suffix is long enough to be worth it: K Rehearse prompts differ after the
    history, and scoring the real responses under them next (surprise) then restores each prompt instead of
    encoding its suffix again; the channel's tool lines recur every turn."""
    for i, seq in enumerate(seqs):
        own = len(seq) - prefix_len
        if own < prefix_cache.min_tokens or prefix_cache.covered(seq) >= len(seq):
            continue
        start = width - (lengths[i] - prefix_len)  # where row i's own tokens start in its buffer
        keys, values = [], []
        for layer in cache.layers:
            if type(layer) is not GrowingLayer or layer.shared_keys is None or layer.shared_values is None:
                return
            own_k, own_v = layer._k, layer._v  # [B, heads, capacity, dim]: row i's suffix ends at `width`
            assert own_k is not None and own_v is not None
            keys.append(torch.cat([layer.shared_keys, own_k[i : i + 1, :, start : start + own]], dim=-2))
            values.append(torch.cat([layer.shared_values, own_v[i : i + 1, :, start : start + own]], dim=-2))
        prefix_cache.store_tensors(list(seq), keys, values)


TOP_P_CANDIDATES = 256
"""`nucleus` looks among this many most likely tokens first (sorting all 49,152 took 3 ms a row a token)."""


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` ([V]) with the tokens outside the nucleus zeroed: tokens are dropped, most likely first, once the
    mass before them reaches `top_p` (the first always stays). The nucleus lies among the TOP_P_CANDIDATES most
    likely tokens whenever those hold `top_p` of the mass (any token after them has that much before it);
    only otherwise is the whole vocabulary sorted. The kept values are the input's, unchanged."""
    k = min(TOP_P_CANDIDATES, probs.numel())
    top, order = probs.topk(k)
    cumulative = top.cumsum(0)
    if k < probs.numel() and cumulative[-1] < top_p:
        top, order = probs.sort(descending=True)
        cumulative = top.cumsum(0)
    keep = cumulative - top < top_p
    return torch.zeros_like(probs).scatter_(0, order[keep], top[keep])


def _choose(logits: torch.Tensor, rows: Sequence[Row], generators: list[torch.Generator | None],
            done: Sequence[bool] | None = None) -> torch.Tensor:
    """Next token per row: argmax for greedy rows, seeded top-p sampling for the others (not for `done` rows,
    whose generators are never used again: a draw over 49,152 tokens costs about a millisecond)."""
    chosen = logits.argmax(dim=-1)
    for i, (row, gen) in enumerate(zip(rows, generators)):
        if gen is None or (done is not None and done[i]):
            continue
        probs = torch.softmax(logits[i].float() / row.temperature, dim=-1)
        if row.top_p < 1.0:
            probs = nucleus(probs, row.top_p)
        # The generator lives on the CPU, so sample there: same seed -> same tokens on any device.
        chosen[i] = torch.multinomial(probs.cpu(), 1, generator=gen).item()
    return chosen


@functools.cache
def _draw_is_uniforms(vocab_size: int) -> bool:
    """Whether one `torch.multinomial` draw (one sample, `vocab_size` tokens) uses the generator as
    `vocab_size` float64 uniforms do: its fast path draws that many exponentials, each from one such uniform.
    Checked once on scratch generators, so another torch that draws differently falls back to real draws."""
    one_hot = torch.zeros(vocab_size)
    one_hot[0] = 1.0
    drawn, advanced = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    torch.multinomial(one_hot, 1, generator=drawn)
    torch.empty(vocab_size, dtype=torch.float64).uniform_(generator=advanced)
    return torch.equal(drawn.get_state(), advanced.get_state())


def _skip_draws(generator: torch.Generator | None, vocab_size: int, n: int) -> None:
    """Advance a sampled row's generator past `n` forced tokens, as `_choose` would have drawn them one step at
    a time (a draw's use of the generator depends on the vocabulary's size only, not on the probabilities):
    jump-forward then changes no sampled text, and K candidates stay as distinct as without it. Where torch
    allows (`_draw_is_uniforms`), by drawing the uniforms alone: 0.21 against 1.03 ms a token over 49,152."""
    if generator is None or n == 0:
        return
    if _draw_is_uniforms(vocab_size):
        scratch = torch.empty(vocab_size, dtype=torch.float64)
        for _ in range(n):
            scratch.uniform_(generator=generator)
        return
    one_hot = torch.zeros(vocab_size)
    one_hot[0] = 1.0
    for _ in range(n):
        torch.multinomial(one_hot, 1, generator=generator)


def _hit_stop(tokenizer: Any, ids: list[int], stop: tuple[str, ...], window: int, matcher: Any = None) -> bool:
    """Whether the decoded tail of `ids` contains a stop string (cheap: only the last tokens). A constrained row
    (`matcher`) stops only where its grammar is complete: a stop string written inside a JSON string (a Rehearse
    value that quotes `</execution_result>`) is text, and stopping there left the value unclosed."""
    if not stop or (matcher is not None and not matcher.accepting):
        return False
    tail = tokenizer.decode(ids[-window:], skip_special_tokens=False)
    return any(s in tail for s in stop)


def _take_forced(tokenizer: Any, matcher: Any, out: RowOutput, stop: tuple[str, ...], window: int,
                 max_new_tokens: int) -> list[int]:
    """The tokens a row's grammar forces next, appended to its output up to a stop string or the budget."""
    taken = []
    for token in matcher.forced(max_new_tokens - len(out.token_ids)):
        out.token_ids.append(token)
        taken.append(token)
        if _hit_stop(tokenizer, out.token_ids, stop, window, matcher):
            break
    return taken


def _chunk(feeds: list[list[int]], positions: torch.Tensor, pad_id: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows feeding different numbers of tokens in one forward: left-padded to the longest, so every row's
    last real token sits in the last column. Returns ids, the mask to append, position ids, and lengths."""
    batch, width = len(feeds), max(len(f) for f in feeds)
    lengths = torch.tensor([len(f) for f in feeds], dtype=torch.long)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    start = positions.cpu()[:, None]
    chunk_positions = start.repeat(1, width)  # pads: any position (masked)
    for i, feed in enumerate(feeds):
        n = len(feed)
        ids[i, width - n :] = torch.tensor(feed)
        mask[i, width - n :] = 1
        chunk_positions[i, width - n :] = start[i] + torch.arange(n)
    return ids, mask, chunk_positions, lengths


def _twins(twin_of: list[int], feeds: list[list[int]], fed: list[bool]) -> torch.Tensor | None:
    """Update `twin_of` for this step's feeds, and return it as a step's `twins` (None when no row has one):
    rows of one sequence stay twins while they feed the same tokens; a finished row is its own."""
    groups: dict[tuple[int, tuple[int, ...]], int] = {}
    for i, feed in enumerate(feeds):
        twin_of[i] = groups.setdefault((twin_of[i], tuple(feed)), i) if fed[i] else i
    return torch.tensor(twin_of) if any(t != i for i, t in enumerate(twin_of)) else None


def _cut_at_stop(text: str, stop: tuple[str, ...], constrained: bool = False) -> str:
    """`text` cut just after its first stop string; a constrained row's just after its last (an earlier one is
    inside the grammar's value, the last is where the grammar ended)."""
    if constrained:
        ends = [text.rfind(s) + len(s) for s in stop if s in text]
        return text[: max(ends)] if ends else text
    ends = [text.find(s) + len(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def generate(
    model: Any,
    tokenizer: Any,
    rows: Sequence[Row],
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int,
    prefix_cache: PrefixCache | None = None,
    timings: Timings | None = None,
    role: str = "generate",
    jump_forward: bool = True,
) -> list[RowOutput]:
    """Decode all rows together until each hits EOS, a stop string, or `max_new_tokens`.
    `timings` gets `<role>.prefill` and `<role>.decode` seconds.

    `jump_forward`: where a row's grammar forces the next tokens (`{"name": "` after `<tool_call>`, the
    closing `}}</tool_call>`), they are taken without a choice and fed in one forward with the next step,
    instead of one decode step each (SGLang's jump-forward decoding); they still get the model's own
    log-probabilities. About half of a constrained call's tokens are forced."""
    outputs = [RowOutput() for _ in rows]
    if max_new_tokens <= 0:
        return outputs
    batch = len(rows)
    generators = [
        torch.Generator().manual_seed(row.seed) if row.temperature > 0 else None for row in rows
    ]
    # Stop strings are text; a token is at least one byte, so this many tokens cover any stop.
    windows = [max((len(s.encode()) for s in row.stop), default=0) + 2 for row in rows]
    done = [False] * batch
    for row in rows:
        if row.matcher is not None:
            row.matcher.budget = max_new_tokens  # a Rehearse row closes its JSON before the budget runs out
    # Rows that are the same sequence so far (K sampled Act rows of one prompt agree on `<tool_call>{"name": "`
    # and often the tool): each points at the first of them, whose keys and logits the native step copies
    # (`fast_step.Step`'s `twins`), so K identical rows cost one until their tokens differ.
    firsts: dict[tuple[int, ...], int] = {}
    twin_of = [firsts.setdefault(tuple(r.ids), i) for i, r in enumerate(rows)]

    timings = timings or Timings()
    with torch.inference_mode(), timings.phase(f"{role}.prefill"):
        pre = prefill(model, [r.ids for r in rows], [1] * batch, keep=1, pad_id=pad_id, prefix_cache=prefix_cache)
    with torch.inference_mode(), timings.phase(f"{role}.decode"):
        cache, mask, positions, padded = pre.cache, pre.attention_mask, pre.next_positions, pre.has_padding
        logits = pre.logits[:, -1, :]
        next_logits = decode_step(model, cache)  # the forward's logits, with less Python per token
        while True:
            # Log-probabilities stay the model's own (unmasked): scores compare texts, not grammars.
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            allowed = [None if done[i] or r.matcher is None else r.matcher.allowed(logits.shape[-1])
                       for i, r in enumerate(rows)]
            tokens = _choose(mask_logits(logits, allowed), rows, generators, done)
            token_lps = logprobs.gather(1, tokens[:, None]).squeeze(1)
            feeds = [[pad_id] for _ in rows]  # finished rows stay in the batch (reshaping the cache costs more)
            fed = [False] * batch  # rows feeding a token of their own (not the finished rows' pad)
            # One host sync per step for all rows.
            for i, (tok, lp) in enumerate(zip(tokens.tolist(), token_lps.tolist())):
                if done[i]:
                    continue
                out = outputs[i]
                out.token_logprobs.append(lp)
                if tok in eos_ids:
                    done[i] = out.finished = True
                    continue
                out.token_ids.append(tok)
                matcher = rows[i].matcher
                if matcher is not None and not matcher.consume(tok):
                    done[i] = True  # cannot happen with a sound mask; stop rather than write garbage
                    continue
                feeds[i], fed[i] = [tok], True
                if jump_forward and matcher is not None:
                    forced_ids = _take_forced(tokenizer, matcher, out, rows[i].stop, windows[i], max_new_tokens)
                    feeds[i] += forced_ids
                    _skip_draws(generators[i], logits.shape[-1], len(forced_ids))
                if _hit_stop(tokenizer, out.token_ids, rows[i].stop, windows[i], matcher):
                    done[i] = out.finished = True
                elif len(out.token_ids) >= max_new_tokens:
                    done[i] = True
            forced = any(len(f) > 1 for f in feeds)  # their log-probabilities come from the next forward
            if all(done) and not forced:
                break
            twins = _twins(twin_of, feeds, fed)
            if not forced:
                # A finished row's new token is masked, and the native step then computes only the live rows
                # (a batch runs until its longest row ends). Without pads or finished rows the mask is all
                # ones: it is skipped, with its per-step cost.
                if any(done) and not padded:
                    mask = torch.ones((batch, cache.get_seq_length()), dtype=mask.dtype, device=mask.device)
                    padded = True
                if padded:
                    live = torch.tensor([[0 if d else 1] for d in done], dtype=mask.dtype, device=mask.device)
                    mask = torch.cat([mask, live], dim=1)
                feed = torch.tensor([f[0] for f in feeds], device=positions.device)
                logits = next_logits(feed[:, None], mask if padded else None, positions[:, None], twins=twins)[:, -1, :]
                positions = positions + 1
                continue
            ids, chunk_mask, chunk_positions, lengths = _chunk(feeds, positions, pad_id)
            chunk_mask[[i for i in range(batch) if not fed[i]]] = 0  # finished rows' pads (forced rows stay)
            if not padded:  # the mask was not kept up to date while it was all ones
                mask = torch.ones((batch, cache.get_seq_length()), dtype=mask.dtype, device=mask.device)
            mask = torch.cat([mask, chunk_mask.to(mask.device)], dim=1)
            padded = padded or bool((chunk_mask == 0).any())
            chunk = next_logits(ids.to(positions.device), mask if padded else None,
                                chunk_positions.to(positions.device), twins=twins)
            width = ids.shape[1]
            for i, feed in enumerate(feeds):
                if len(feed) > 1:  # the forced tokens' log-probabilities, each from the position before it
                    lps = torch.log_softmax(chunk[i, width - len(feed) : width - 1].float(), dim=-1)
                    outputs[i].token_logprobs += lps.gather(1, torch.tensor(feed[1:])[:, None]).squeeze(1).tolist()
            logits = chunk[:, -1, :]
            positions = positions + lengths.to(positions.device)
            if all(done):
                break

    for row, out in zip(rows, outputs):
        out.text = _cut_at_stop(tokenizer.decode(out.token_ids, skip_special_tokens=False), row.stop,
                                constrained=row.matcher is not None)
    return outputs


PROMPT_CACHE_MAX_TOKENS = 256
"""`score` keeps the KV of prompts shorter than this in its `prompt_cache` (the channel's tool lines, the same
every turn and in every task with the tool); longer ones (the episode's Rehearse prompts) go to `prefix_cache`."""
RESTORE_MAX_POSITIONS = 4096
"""Restored prompt positions per scoring batch: each row's prompt KV is copied (46 KB a position for SmolLM2-135M)."""
PAD_SLACK = 1.2
MIN_PAD_SLACK = 8
"""`score` starts a new chunk at a row longer than PAD_SLACK x the chunk's shortest + MIN_PAD_SLACK tokens."""


def score(
    model: Any,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    pad_id: int,
    max_positions: int = 1024,
    prefix_cache: PrefixCache | None = None,
    prompt_cache: PrefixCache | None = None,
) -> list[list[float]]:
    """Log-probability of each continuation token after its prompt (forward only, shared prefix).

    Rows go in chunks of at most `max_positions` scored positions, because the kept logits cost
    vocabulary-size floats per position (49,152 for SmolLM2: 1,024 positions are 200 MB). Rows are
    chunked shortest first, and a row much longer than its chunk's first starts a new chunk: a batch
    pads every row to its longest, and on a CPU the padded positions cost as much as real ones (the
    channel's 32 tool prompts of 53-124 tokens were 45% padding in prompt order).

    Rows with prompts of their own (not one prompt for all) whose KV a cache holds, all but the last
    token, are not encoded again: their stored prompts are restored side by side into one batch cache
    and only the continuations run, one forward per chunk (`_score_restored`). Short prompts computed
    here are kept in `prompt_cache`, long ones in `prefix_cache` (see PROMPT_CACHE_MAX_TOKENS).
    """
    results: list[list[float]] = [[] for _ in prompts]
    rows = [i for i, c in enumerate(continuations) if c]
    length = [len(prompts[i]) + len(continuations[i]) for i in range(len(prompts))]
    probe = new_cache(model.config)
    if any(type(layer) is not GrowingLayer for layer in probe.layers):
        prefix_cache = prompt_cache = None  # a sliding-window layer's cache cannot be cut at a position
    distinct = len({tuple(prompts[i]) for i in rows})
    if len(rows) > 1 and distinct == 1 and len(prompts[rows[0]]) > 1 and lean_supported(model, probe):
        tree = TokenTree([continuations[i] for i in rows])
        if len(tree.tokens) < max_positions:
            _score_tree(model, prompts[rows[0]], tree, prefix_cache, [results[i] for i in rows])
            return results
    caches = [c for c in (prefix_cache, prompt_cache) if c is not None]
    stored: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    if caches and len(rows) > 1 and distinct == len(rows):
        for i in rows:
            found = next((f for c in caches if (f := c.lookup(prompts[i][:-1])) is not None), None)
            if found is not None:
                stored[i] = found
    for chunk in _chunks(sorted(stored, key=lambda i: length[i]), prompts, continuations, max_positions, True):
        _score_restored(model, prompts, continuations, chunk, stored, pad_id, results)
    rest = sorted((i for i in rows if i not in stored), key=lambda i: length[i])
    for chunk in _chunks(rest, prompts, continuations, max_positions, False):
        _score_chunk(model, prompts, continuations, chunk, pad_id, results, prefix_cache, prompt_cache)
    return results


class TokenTree:
    """Continuations of one prompt as a trie: a token shared by several continuations' same beginnings is one
    node. Node 0 is left for the prompt's last token (its logits predict every first token)."""

    def __init__(self, continuations: Sequence[Sequence[int]]) -> None:
        self.tokens: list[int] = [-1]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self._nodes: dict[tuple[int, ...], int] = {(): 0}
        self.continuations = [list(c) for c in continuations]
        for continuation in self.continuations:
            path: tuple[int, ...] = ()
            for token in continuation:
                child = (*path, token)
                if child not in self._nodes:
                    self._nodes[child] = len(self.tokens)
                    self.tokens.append(token)
                    self.parents.append(self._nodes[path])
                    self.depths.append(len(child))
                path = child

    def ancestry(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j when j is i or one of its ancestors."""
        seen = torch.eye(len(self.tokens), dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:  # a parent comes before its children: its row is complete
                seen[i] |= seen[parent]
        return seen

    def path(self, continuation: Sequence[int]) -> list[int]:
        """The nodes of a continuation's tokens, in order."""
        return [self._nodes[tuple(continuation[: n + 1])] for n in range(len(continuation))]

    def predicting(self, continuation: Sequence[int]) -> list[int]:
        """The node whose logits predict each token of a continuation: the node of the path before it."""
        return [self._nodes[tuple(continuation[:n])] for n in range(len(continuation))]


def _score_tree(model: Any, prompt: Sequence[int], tree: TokenTree, prefix_cache: PrefixCache | None,
                results: list[list[float]]) -> None:
    """Continuations of one prompt (the tool names ranked after the Act prompt) scored as one token tree in a
    single row after the prompt, each node attending to the prompt and to its own ancestors (tree attention,
    as SpecInfer and Medusa verify trees of draft tokens). Batched instead, 32 tool names of 109 tokens were
    320 padded positions; as a tree they are 99 nodes."""
    cache = new_cache(model.config)
    with torch.inference_mode():
        encode_prefix(model, list(prompt[:-1]), cache, prefix_cache)
        held = len(prompt) - 1
        ids = torch.tensor([[prompt[-1], *tree.tokens[1:]]], device=model.device)
        positions = torch.tensor([[held + d for d in tree.depths]], device=model.device)
        logits = lean_step(model, cache)(ids, None, positions, ids.shape[1], tree=tree.ancestry().to(model.device))
        logprobs = torch.log_softmax(logits[0].float(), dim=-1)
        for out, continuation in zip(results, tree.continuations):
            out[:] = logprobs[tree.predicting(continuation), continuation].tolist()


def _chunks(order: list[int], prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
            max_positions: int, restored: bool) -> list[list[int]]:
    """Consecutive rows of `order` (shortest first) in batches: at most `max_positions` scored positions, no
    row much longer than the batch's first, and (`restored`) at most RESTORE_MAX_POSITIONS restored ones."""
    chunks: list[list[int]] = []
    chunk: list[int] = []
    for i in order:
        if chunk:
            rows = chunk + [i]
            full = (len(rows) * (max(len(continuations[j]) for j in rows) + 1) > max_positions
                    or len(prompts[i]) + len(continuations[i])
                    > PAD_SLACK * (len(prompts[chunk[0]]) + len(continuations[chunk[0]])) + MIN_PAD_SLACK
                    or restored and len(rows) * max(len(prompts[j]) for j in rows) > RESTORE_MAX_POSITIONS)
            if full:
                chunks.append(chunk)
                chunk = []
        chunk.append(i)
    return chunks + [chunk] if chunk else chunks


def _score_restored(
    model: Any,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    rows: list[int],
    stored: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]],
    pad_id: int,
    results: list[list[float]],
) -> None:
    """Rows whose prompts (all but the last token) are stored: the stored KV side by side in one batch cache,
    right-aligned ([pads | prompt] per row, the pads masked), then each row's last prompt token and
    continuation in one forward, with position ids that continue each row's own prompt."""
    batch = len(rows)
    held = [len(prompts[i]) - 1 for i in rows]
    span = max(held)
    cache = new_cache(model.config)
    with torch.inference_mode():
        for layer_index, layer in enumerate(cache.layers):
            first = stored[rows[0]][0][layer_index]
            keys = first.new_zeros((batch, first.shape[1], span, first.shape[-1]))
            values = torch.zeros_like(keys)
            for b, i in enumerate(rows):
                keys[b, :, span - held[b]:] = stored[i][0][layer_index][0]
                values[b, :, span - held[b]:] = stored[i][1][layer_index][0]
            layer.append(keys, values)
    feeds = [[prompts[i][-1], *continuations[i]] for i in rows]
    width = max(len(f) for f in feeds)
    ids = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, span + width), dtype=torch.long)
    positions = torch.tensor(held, dtype=torch.long)[:, None].repeat(1, width)  # pads: the first real one's
    for b, feed in enumerate(feeds):
        n = len(feed)
        ids[b, width - n:] = torch.tensor(feed)
        mask[b, span - held[b]: span] = 1
        mask[b, span + width - n:] = 1
        positions[b, width - n:] = torch.arange(held[b], held[b] + n)
    device = model.device
    with torch.inference_mode():
        logits = generic_step(model, cache)(ids.to(device), mask.to(device), positions.to(device), width)
        for b, i in enumerate(rows):
            cont = torch.tensor(continuations[i], device=logits.device)
            n = len(cont)
            lps = torch.log_softmax(logits[b, width - n - 1 : width - 1].float(), dim=-1).gather(1, cont[:, None])
            results[i] = lps.squeeze(1).tolist()


def _score_chunk(
    model: Any,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    rows: list[int],
    pad_id: int,
    results: list[list[float]],
    prefix_cache: PrefixCache | None = None,
    prompt_cache: PrefixCache | None = None,
) -> None:
    seqs = [list(prompts[i]) + list(continuations[i]) for i in rows]
    # The token before each continuation must sit in the suffix: its logits predict the first one.
    min_suffix = [len(continuations[i]) + 1 for i in rows]
    keep = max(min_suffix)
    short = prompt_cache is not None and all(len(prompts[i]) < PROMPT_CACHE_MAX_TOKENS for i in rows)
    with torch.inference_mode():
        pre = prefill(model, seqs, min_suffix, keep=keep, pad_id=pad_id, prefix_cache=prefix_cache,
                      rows_cache=prompt_cache if short else None,
                      rows_stored=[len(prompts[i]) for i in rows] if short else None)
        for row, i in enumerate(rows):
            cont = torch.tensor(continuations[i], device=pre.logits.device)
            n = len(cont)
            logits = pre.logits[row, keep - n - 1 : keep - 1].float()
            lps = torch.log_softmax(logits, dim=-1).gather(1, cont[:, None]).squeeze(1)
            results[i] = lps.tolist()
