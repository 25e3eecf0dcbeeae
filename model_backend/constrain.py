"""Schema-constrained decoding: a `Constraint` compiled into one llguidance matcher per row.

llguidance (not xgrammar): both compute token masks far faster than a CPU forward pass
(~0.1 ms per token against ~70 ms), but xgrammar pulls in triton (1 GB); llguidance is an
8 MB wheel with no dependencies whose Lark grammars embed a JSON schema directly
(`%json {...}`), so "plain text, or a tagged call" is one short grammar, with the exact
separators `json.dumps` writes: constrained output reads like the training targets.

A grammar that cannot be built (an unsupported schema feature) is logged once per grammar
and the row decodes unconstrained: a constraint is a help, never a reason to crash.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from .base import Constraint
from .grammars import grammar_text
from .loops import MAX_REPEATS, open_string, repeated_phrase

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Any) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


@functools.lru_cache(maxsize=256)
def _checked(grammar: str) -> str | None:
    """None when llguidance accepts the grammar, else its error (cached: prompts repeat tools)."""
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, RuntimeError) as exc:
        return str(exc) or "invalid grammar"
    return (messages[0] if messages else "invalid grammar") if is_error else None


class ConstraintError(ValueError):
    """A constraint whose grammar llguidance cannot build."""


@functools.lru_cache(maxsize=64)
def _fresh_matcher(tokenizer: Any, grammar: str) -> Any:
    """A matcher of `grammar` in its start state, which rows copy (`deep_copy`: microseconds, where building one
    took 9 ms for BFCL's file-system tools; a step builds one per row, K Act rows and the tool-forced calls)."""
    import llguidance

    error = _checked(grammar)
    if error:
        raise ConstraintError(error.strip().splitlines()[0])
    matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer), grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(matcher.get_error().splitlines()[0])
    return matcher


CLOSE_MARGIN = 16
"""With `Constraint.close_strings`, this many tokens before the budget the row starts closing its JSON (a
quarter of the budget where that is less: a 26-token budget keeps 20 tokens for the value, not 10)."""
_CLOSERS = frozenset('"}]')


@functools.lru_cache(maxsize=16)
def _closing_tokens(tokenizer: Any, in_string: bool = False) -> torch.Tensor:
    """A bool mask [len(tokenizer)] of the tokens made only of `"`, `}` and `]`: what closes a JSON value. Inside
    a string only those starting with `"` (there `}` and `]` are text: a row closing "..."}}}}" wrote them
    into the string until its budget ran out, 80 times in one rehearsal)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([bool(t) and set(t) <= _CLOSERS and (not in_string or t.startswith('"')) for t in tokens],
                        dtype=torch.bool)


_FINISHER_CHARS = frozenset('"}]:')
_FINISHER_WORDS = frozenset({"null", "0", "false", "true"})


@functools.lru_cache(maxsize=16)
def _finishing_tokens(tokenizer: Any) -> torch.Tensor:
    """A bool mask [len(tokenizer)] of the tokens that finish a JSON value where no closer is allowed yet: `:`
    after a key and the shortest values (`null`, `0`, `true`, `false`, an opening `"` that closing then shuts),
    with closers. After `"key"` or `"key":` an object cannot be closed, and a row free to write there wrote new
    keys until its budget ran out (tau2's long records)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([bool(t) and (set(t) <= _FINISHER_CHARS or t.lstrip("\u0120") in _FINISHER_WORDS)
                         for t in tokens], dtype=torch.bool)


class RowMatcher:
    """The grammar state of one decoded row: which tokens may come next, fed token by token.

    With `Constraint.close_strings` (Rehearse), a string that starts to loop (a phrase at its `MAX_REPEATS`-th
    repeat in a row, `loops.repeated_phrase`) is closed and, `CLOSE_MARGIN` tokens before `budget`, the whole
    value is: where the grammar allows a closing token
    (`"`, `}`, `]`) only those are allowed, so the prediction ends as valid JSON instead of being cut off; where it
    allows none (after a key) only the shortest way to one (`_finishing_tokens`).
    """

    def __init__(self, tokenizer: Any, constraint: Constraint) -> None:
        self._matcher = _fresh_matcher(tokenizer, grammar_text(constraint)).deep_copy()
        self._tokenizer = tokenizer
        self.close_strings = constraint.close_strings
        self.budget: int | None = None
        """The row's token budget (the decoder sets it); None: no budget closing."""
        self.consumed = 0
        self.closed = 0
        """How many times a string was closed early (a loop, or the budget)."""
        self._text = ""

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """A bool mask [vocab_size] of the tokens the grammar allows next (EOS when complete)."""
        words = (vocab_size + 31) // 32
        bits = torch.full((words,), -1, dtype=torch.int32)
        self._matcher.unsafe_compute_mask_ptr(bits.data_ptr(), words * 4)
        shifts = torch.arange(32, dtype=torch.int32)
        mask = ((bits[:, None] >> shifts) & 1).bool().reshape(-1)[:vocab_size]
        if self.close_strings and self._closing():
            closers = _closing_tokens(self._tokenizer, open_string(self._text) is not None)
            width = min(vocab_size, closers.shape[0])
            closing = mask.clone()
            closing[:width] &= closers[:width]
            closing[width:] = False
            if bool(closing.any()):
                self.closed += 1
                return closing
            if open_string(self._text) is None:  # e.g. after a key: `:` and a short value, then the closers
                finishers = _finishing_tokens(self._tokenizer)
                closing[:width] = mask[:width] & finishers[:width]
                if bool(closing.any()):
                    return closing
        return mask

    def _closing(self) -> bool:
        if self.budget is not None and self.consumed >= self.budget - min(CLOSE_MARGIN, max(2, self.budget // 4)):
            return True
        current = open_string(self._text)
        # Closed at the MAX_REPEATS-th repeat, so a closed string never counts as a loop (`repeated_phrase` counts
        # more than MAX_REPEATS): closing at the next one left all 12 loops of 290 held-out calls in the count.
        return current is not None and repeated_phrase(current, MAX_REPEATS - 1) is not None

    def consume(self, token: int) -> bool:
        """Advance by one token; False when the grammar rejects it (the row then stops)."""
        ok = bool(self._matcher.consume_token(token))
        if ok and self.close_strings:
            self.consumed += 1
            self._text += self._tokenizer.decode([token])
        return ok

    def forced(self, limit: int) -> list[int]:
        """Consume and return the tokens the grammar forces from here (at most `limit`): the only way on, so
        the model need not choose them one decode step at a time (jump-forward decoding)."""
        taken: list[int] = []
        for token in self._matcher.compute_ff_tokens()[:limit]:
            if not self.consume(token):
                break
            taken.append(token)
        return taken

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        return bool(self._matcher.is_accepting())



def matcher_for(tokenizer: Any, constraint: Constraint | None) -> RowMatcher | None:
    """A matcher for `constraint`, or None (no constraint, or one that cannot be built: warned)."""
    if constraint is None:
        return None
    try:
        return RowMatcher(tokenizer, constraint)
    except ConstraintError as exc:
        if str(exc) not in _WARNED:  # K rows and every step share the grammar: say it once
            _WARNED.add(str(exc))
            log.warning("constrained decoding off for this prompt: the grammar cannot be built (%s)", exc)
        return None


_WARNED: set[str] = set()


def mask_logits(logits: torch.Tensor, allowed: list[torch.Tensor | None]) -> torch.Tensor:
    """`logits` [B, V] with disallowed tokens at -inf for the rows that have a mask (a copy)."""
    if all(a is None for a in allowed):
        return logits
    masked = logits.clone()
    for i, mask in enumerate(allowed):
        if mask is not None:
            width = min(mask.shape[0], masked.shape[1])
            row = masked[i]
            row[:width].masked_fill_(~mask[:width].to(row.device), float("-inf"))
            row[width:] = float("-inf")
    return masked
