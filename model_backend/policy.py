"""The two roles on one set of local weights: act (K candidates) and rehearse, plus scoring."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
from array import array
from collections import OrderedDict
from typing import Any, Callable, Iterator

from . import fast_step
from .base import AheadStopped, Constraint, Generation, GenerationConfig, Policy, Prompt, Timings, derive_seed
from .constrain import matcher_for
from .decoding import Row, RowOutput, generate, score
from .loading import LoadedModel
from .prefix_cache import DEFAULT_MAX_BYTES, PrefixCache

log = logging.getLogger(__name__)

DEFAULT_CONTEXT_WINDOW = 8192
PROMPT_CACHE_BYTES = 256 * 2**20
"""`TransformersPolicy.prompt_cache`: about 50 tool lines of ~110 tokens at 46 KB a token (SmolLM2-135M)."""
SCORE_MEMO_ENTRIES = 4096
"""`score` results kept per loaded model. They depend only on the weights and the tokens, so a task run
again (another mode of an eval, a person re-running a task) reuses them: above all the tool channel's
pass over every tool description, a few seconds per user turn (`app.engine.proposals.relevance`)."""


AHEAD_POLL_S = 0.02
"""How often work ahead waiting for the model checks whether to stop."""
AHEAD_SCORE_TOKENS = 1024
"""Work ahead scores about this many tokens a turn at the model (`TransformersPolicy.score`; a prompt shared by
rows counts once)."""
AHEAD_ENTRIES = 32
"""Generation results computed ahead (`TransformersPolicy.computing_ahead`) kept at most, until a call asks for
them (a step makes three to five generate calls)."""


def _generation_key(rows: list[Row], constraints: list[Constraint | None], max_new_tokens: int) -> bytes:
    """Everything a batch's outputs depend on, given the weights: each row's tokens, sampling, seed, stops and
    constraint, and the token budget."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str(max_new_tokens).encode())
    grammars: dict[int, str] = {}  # K rows share one constraint (all the step's tool schemas): dumped once
    for row, constraint in zip(rows, constraints):
        digest.update(array("l", row.ids).tobytes())
        if id(constraint) not in grammars:
            grammars[id(constraint)] = json.dumps(None if constraint is None else dataclasses.asdict(constraint),
                                                  sort_keys=True, default=str)
        digest.update(json.dumps([row.temperature, row.top_p, row.seed, list(row.stop)]).encode())
        digest.update(grammars[id(constraint)].encode())
        digest.update(b"|")
    return digest.digest()


def _slices(prompt_of: list[int], prompt_ids: list[list[int]], cont_ids: list[list[int]], budget: int) -> list[slice]:
    """Consecutive rows in slices of about `budget` tokens (each slice at least one row); a prompt that rows share
    (`prompt_of`: the same id) counts once a slice."""
    out, start, tokens, seen = [], 0, 0, set()
    for i, (p, c) in enumerate(zip(prompt_ids, cont_ids)):
        cost = len(c) + (0 if prompt_of[i] in seen else len(p))
        if i > start and tokens + cost > budget:
            out.append(slice(start, i))
            start, tokens, seen = i, 0, set()
            cost = len(c) + len(p)
        tokens += cost
        seen.add(prompt_of[i])
    out.append(slice(start, len(prompt_ids)))
    return out


def _score_key(prompt: list[int], continuation: list[int]) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(array("l", prompt).tobytes())
    digest.update(b"|")
    digest.update(array("l", continuation).tobytes())
    return digest.digest()


class TransformersPolicy(Policy):
    """`Policy` over a transformers causal LM; batches internally over a shared prompt prefix."""

    def __init__(self, loaded: LoadedModel, prefix_cache_bytes: int = DEFAULT_MAX_BYTES,
                 score_memo: int = SCORE_MEMO_ENTRIES) -> None:
        """`prefix_cache_bytes`: memory for the KV of recent prompt prefixes (0: no cross-step cache);
        `score_memo`: how many `score` results to keep (0 for a model whose weights change under it: then no
        `prompt_cache` either)."""
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.name: str = loaded.spec
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        eos_ids = {eos} if isinstance(eos, int) and eos != self.tokenizer.unk_token_id else set()
        config_eos = getattr(self.model.config, "eos_token_id", None)
        eos_ids |= set(config_eos) if isinstance(config_eos, list) else {config_eos} - {None}
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_ids: set[int] = eos_ids
        pad = self.tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else min(eos_ids)
        # One forward at a time: concurrent UI requests would only fight over the same cores.
        self._lock = threading.Lock()
        self.prefix_cache: PrefixCache | None = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.score_memo = score_memo
        self.prompt_cache: PrefixCache | None = (
            PrefixCache(PROMPT_CACHE_BYTES) if score_memo > 0 and prefix_cache_bytes > 0 else None)
        """KV of short prompts `score` has encoded (the channel's tool lines), kept across episodes: an episode
        reset does not clear it (`forget_scores` does), since those prompts hold nothing of an episode."""
        self._scores: OrderedDict[bytes, list[float]] = OrderedDict()
        """Recent `score` results by (prompt, continuation) tokens (see `score`)."""
        self._ahead: OrderedDict[bytes, list[RowOutput]] = OrderedDict()
        """Generation results computed ahead, by `_generation_key`, until a call takes them (`computing_ahead`)."""
        self._computing_ahead = threading.local()
        self._demand = 0
        """Calls outside `computing_ahead` waiting for the model or using it (`in_demand`)."""
        self._demand_lock = threading.Lock()
        fast_step.prepare_native(self.model)
        self.timings = Timings()
        """Seconds per phase (`act.tokenize`, `act.prefill`, `act.decode`, `rehearse.*`, `score.*`)."""

    def reset_cache(self) -> None:
        """Forget cached prompt prefixes (an episode reset; results never depend on it). Results computed ahead
        stay: they are keyed by every token they depend on, and may be another session's next step."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def __repr__(self) -> str:
        return f"TransformersPolicy({self.name!r}, device={self.loaded.device}, adapter={self.loaded.adapter!r})"

    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", DEFAULT_CONTEXT_WINDOW))

    def render(self, prompt: Prompt) -> str:
        """The prompt as the model reads it: chat template with a generation prompt, then the prefill."""
        return prompt.render(self.tokenizer)

    def encode(self, prompt: Prompt) -> list[int]:
        # transformers 5 returns a BatchEncoding for tokenize=True, so render then encode.
        return list(self.tokenizer.encode(self.render(prompt), add_special_tokens=False))

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _budget(self, prompt_lens: list[int], max_new_tokens: int) -> int:
        longest = max(prompt_lens)
        if longest >= self.context_window:
            raise ValueError(f"prompt of {longest} tokens does not fit the {self.context_window}-token context")
        return min(max_new_tokens, self.context_window - longest)

    @property
    def can_compute_ahead(self) -> bool:
        """Whether `computing_ahead` pays: its scores are kept too (`score_memo` > 0, weights that do not change)."""
        return self.score_memo > 0

    @property
    def in_demand(self) -> bool:
        """Whether a call outside `computing_ahead` (a step someone waits for) is waiting for the model or using
        it: work ahead then gives way."""
        return self._demand > 0

    @contextlib.contextmanager
    def _model(self) -> Iterator[None]:
        """The model, one call at a time. A call outside `computing_ahead` counts as demand while it waits and
        runs; one inside waits only while its `stop` is false and nobody else asks (else `AheadStopped`)."""
        local = self._computing_ahead
        if getattr(local, "on", False):
            while not self._lock.acquire(timeout=AHEAD_POLL_S):
                if local.stop() or self.in_demand:
                    raise AheadStopped()
            try:
                if local.stop() or self.in_demand:
                    raise AheadStopped()
                yield
            finally:
                self._lock.release()
            return
        with self._demand_lock:
            self._demand += 1
        try:
            with self._lock:
                yield
        finally:
            with self._demand_lock:
                self._demand -= 1

    @contextlib.contextmanager
    def computing_ahead(self, stop: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Generation results this thread makes inside are kept (at most `AHEAD_ENTRIES`) for the first call
        that asks for the same batch (`_generation_key`), which takes them instead of generating; `score`
        results are kept anyway. `EpisodeRunner.compute_ahead` computes the next step so while a person reads
        the last one. Outputs depend only on the weights and the key (sampled rows draw from generators seeded
        per row), so a taken result is the one the call would have computed. Before each model call (and while
        waiting for the model), `stop()` or a call from outside (`in_demand`) raises `AheadStopped`: the call
        running then finishes, and is kept."""
        local = self._computing_ahead
        local.on, local.stop = True, stop
        try:
            yield
        finally:
            local.on = False

    def _generate(self, rows: list[Row], max_new_tokens: int, role: str,
                  constraints: list[Constraint | None]) -> list[RowOutput]:
        budget = self._budget([len(r.ids) for r in rows], max_new_tokens)
        ahead = bool(getattr(self._computing_ahead, "on", False))
        key = _generation_key(rows, constraints, budget) if ahead or self._ahead else None
        with self._model():
            if key is not None and key in self._ahead:
                kept = self._ahead.pop(key)
                if ahead:  # computed ahead twice: keep it for the call that will ask
                    self._ahead[key] = kept
                return kept
            outs = generate(self.model, self.tokenizer, rows, budget, self.eos_ids, self.pad_id, self.prefix_cache,
                            self.timings, role)
            if ahead and key is not None:
                self._ahead[key] = outs
                while len(self._ahead) > AHEAD_ENTRIES:
                    self._ahead.popitem(last=False)
            return outs

    def _matcher(self, prompt: Prompt) -> Any:
        """One grammar state per row (rows advance separately); None without a constraint."""
        return matcher_for(self.tokenizer, prompt.constraint)

    @staticmethod
    def _to_generation(prefill: str, out: RowOutput, sampled: bool) -> Generation:
        return Generation(prefill + out.text, out.token_logprobs, out.finished, sampled)

    def act(self, prompt: Prompt, k: int, config: GenerationConfig) -> list[Generation]:
        """K candidates: row 0 greedy, rows 1..K-1 sampled with seeds derived from `config.seed`."""
        if k < 1:
            return []
        with self.timings.phase("act.tokenize"):
            ids = self.encode(prompt)
        rows = [Row(ids, stop=config.stop, matcher=self._matcher(prompt))]
        rows += [
            Row(ids, config.temperature, config.top_p, derive_seed(config.seed, i), config.stop, self._matcher(prompt))
            for i in range(1, k)
        ]
        outs = self._generate(rows, config.max_new_tokens, "act", [prompt.constraint] * k)
        return [self._to_generation(prompt.prefill, o, row.temperature > 0) for o, row in zip(outs, rows)]

    def act_each(self, prompts: list[Prompt], config: GenerationConfig) -> list[Generation]:
        """One greedy candidate per prompt, all in one batch (timed as `act`)."""
        return self._greedy_each(prompts, config, "act")

    def rehearse(self, prompts: list[Prompt], config: GenerationConfig) -> list[Generation]:
        """One greedy continuation per prompt, all in one batch."""
        return self._greedy_each(prompts, config, "rehearse")

    def _greedy_each(self, prompts: list[Prompt], config: GenerationConfig, role: str) -> list[Generation]:
        if not prompts:
            return []
        with self.timings.phase(f"{role}.tokenize"):
            rows = [Row(self.encode(p), stop=config.stop, matcher=self._matcher(p)) for p in prompts]
        outs = self._generate(rows, config.max_new_tokens, role, [p.constraint for p in prompts])
        return [self._to_generation(p.prefill, o, False) for p, o in zip(prompts, outs)]

    def score(self, prompts: list[Prompt], continuations: list[str]) -> list[list[float]]:
        """Per-token log-probabilities of each continuation after its prompt + prefill (forward only)."""
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        if not prompts:
            return []
        with self.timings.phase("score.tokenize"):
            # Each distinct prompt and continuation once: callers repeat them (one Act prompt under every tool
            # name, one request under every tool line), and a 1,000-token prompt takes a millisecond or two.
            by_prompt: dict[int, list[int]] = {}
            for p in prompts:
                if id(p) not in by_prompt:
                    by_prompt[id(p)] = self.encode(p)
            by_text = {c: list(self.tokenizer.encode(c, add_special_tokens=False)) for c in set(continuations)}
            prompt_ids = [by_prompt[id(p)] for p in prompts]
            cont_ids = [by_text[c] for c in continuations]
            keys = [_score_key(p, c) for p, c in zip(prompt_ids, cont_ids)]
        self._budget([len(p) + len(c) + 1 for p, c in zip(prompt_ids, cont_ids)], 0)
        if getattr(self._computing_ahead, "on", False):
            # Work ahead scores in slices, each its own turn at the model: a step someone waits for then waits
            # for one slice at most (the channel's pass over a new task's tools took 2-4 s as one call).
            for part in _slices([id(p) for p in prompts], prompt_ids, cont_ids, AHEAD_SCORE_TOKENS):
                with self._model():
                    self._score_missing(keys[part], prompt_ids[part], cont_ids[part])
        with self._model():
            self._score_missing(keys, prompt_ids, cont_ids)
            results = []
            for key in keys:
                self._scores.move_to_end(key)
                results.append(list(self._scores[key]))
            while len(self._scores) > self.score_memo:
                self._scores.popitem(last=False)
            return results

    def _score_missing(self, keys: list[bytes], prompt_ids: list[list[int]], cont_ids: list[list[int]]) -> None:
        """Score the rows whose results are not kept yet, and keep them (the caller holds the model)."""
        missing = [i for i, key in enumerate(keys) if key not in self._scores]
        if missing:
            with self.timings.phase("score.forward"):
                fresh = score(self.model, [prompt_ids[i] for i in missing], [cont_ids[i] for i in missing],
                              self.pad_id, prefix_cache=self.prefix_cache, prompt_cache=self.prompt_cache)
            for i, lps in zip(missing, fresh):
                self._scores[keys[i]] = lps

    def forget_scores(self, prompts: bool = True) -> None:
        """Drop the kept results of `score` and those computed ahead, and with `prompts` the `prompt_cache` too
        (a benchmark that times first scorings)."""
        with self._lock:
            self._scores.clear()
            self._ahead.clear()
            if prompts and self.prompt_cache is not None:
                self.prompt_cache.clear()

    def reference_generate(self, prompt: Prompt, max_new_tokens: int) -> str:
        """Plain `model.generate` greedy text for one prompt (tests and the benchmark compare against it)."""
        import torch

        ids = torch.tensor([self.encode(prompt)], device=self.loaded.device)
        with self._lock, torch.inference_mode():
            out: Any = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=sorted(self.eos_ids),
                pad_token_id=self.pad_id,
            )
        new = [t for t in out[0, ids.shape[1] :].tolist() if t not in self.eos_ids]
        return prompt.prefill + self.tokenizer.decode(new, skip_special_tokens=False)
