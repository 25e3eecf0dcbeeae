"""The model interface the engine sees: two roles (act, rehearse) and scoring.

Kept free of torch so that the CLI and UI import fast; backends implement `Policy`.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Protocol, runtime_checkable


@dataclass
class Constraint:
    """What the generated part of a reply may be: `open + JSON + close`, or else plain text.

    Backends that decode locally compile it into a grammar (model_backend/constrain.py);
    others may ignore it. `schema` holds only JSON-schema features the grammar supports.
    """

    schema: dict[str, Any]
    """JSON schema of the JSON body."""
    open: str = ""
    """Text before the JSON (empty when the prompt's prefill already wrote it)."""
    close: str = ""
    """Text after the JSON."""
    allow_text: bool = False
    """A plain-text reply is allowed instead (one that does not start like a call)."""
    close_strings: bool = False
    """Close a string that starts to loop, and close the value before the token budget runs out
    (`constrain.RowMatcher`): a Rehearse prediction is always complete JSON."""


@dataclass
class Prompt:
    """A chat prompt plus an optional prefill of the assistant's reply."""

    messages: list[dict[str, str]]
    """Chat messages (`role` in system/user/assistant/tool, `content`)."""
    prefill: str = ""
    """Text the assistant's reply is forced to start with (part of the reply, not generated)."""
    constraint: Constraint | None = None
    """What the generated text after the prefill may be (None: anything)."""

    def render(self, tokenizer: Any, **template_kwargs: Any) -> str:
        """The prompt as the model reads it: `tokenizer`'s chat template with a generation prompt, then the
        prefill. The one render of a prompt: the local policy, training rows and a served model's completions
        all read the same text (`template_kwargs`, e.g. `enable_thinking`, go to the template)."""
        text = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True,
                                             **template_kwargs)
        return str(text) + self.prefill


@dataclass
class Generation:
    """One generated continuation."""

    text: str
    """The reply, including the prefill, up to and including a stop string; no EOS token text."""
    token_logprobs: list[float] = field(default_factory=list)
    """Log-probability of each generated token (prefill excluded) under the sampling-free model."""
    finished: bool = True
    """False when the token budget ran out before a stop string or EOS."""
    sampled: bool = False
    """False for the greedy candidate."""

    @property
    def logprob(self) -> float:
        return float(sum(self.token_logprobs))

    @property
    def mean_logprob(self) -> float:
        return self.logprob / max(1, len(self.token_logprobs))


@dataclass
class GenerationConfig:
    max_new_tokens: int = 96
    temperature: float = 0.8
    """For sampled candidates; the primary candidate is always greedy."""
    top_p: float = 0.95
    seed: int = 0
    stop: tuple[str, ...] = ()
    """Generation of a row ends after any of these strings (or at EOS)."""


def derive_seed(seed: int, row: int) -> int:
    """A distinct, reproducible seed per sampled row (row 1 of seed 0 differs from row 0 of seed 1)."""
    return (seed * 1_000_003 + row * 7_919) % (2**63)


@runtime_checkable
class Policy(Protocol):
    """One set of weights, two roles. Backends batch internally; callers never see batches."""

    name: str
    """The model spec this policy was built from, e.g. `embedded`."""

    def act(self, prompt: Prompt, k: int, config: GenerationConfig) -> list[Generation]:
        """K candidates for one prompt: index 0 greedy, 1..K-1 sampled (seeded)."""
        ...

    def act_each(self, prompts: list[Prompt], config: GenerationConfig) -> list[Generation]:
        """One greedy candidate per prompt, batched: alternatives that differ in prefill or constraint
        (e.g. each forced onto another tool, `app.engine.proposals`)."""
        ...

    def rehearse(self, prompts: list[Prompt], config: GenerationConfig) -> list[Generation]:
        """One greedy prediction per prompt (the tool's response)."""
        ...

    def score(self, prompts: list[Prompt], continuations: list[str]) -> list[list[float]]:
        """Per-token log-probabilities of each continuation after its prompt (+ prefill)."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens in a piece of text under this model's tokenizer."""
        ...

    @property
    def context_window(self) -> int:
        ...

    # Capabilities: declared here with their defaults, so that a backend or a wrapper that subclasses `Policy`
    # has every one, and the engine reads them as attributes (never probes them). A wrapper forwards each
    # (`CAPABILITIES`); `tests/test_engine.py` checks that the UI's wrapper does.

    @property
    def inner(self) -> Policy:
        """The policy that does the work, under wrappers that only report on it (the UI's progress bar): work
        ahead runs on it, unreported. A backend is its own."""
        return self

    @property
    def supports_scoring(self) -> bool:
        """Whether `score` works (False: a server without prompt log-probabilities; the engine then runs without
        tool relevance and `surprise`, and refuses the judge selector)."""
        return True

    @property
    def can_compute_ahead(self) -> bool:
        """Whether `computing_ahead` pays: results computed ahead are kept for the step that asks for them."""
        return False

    def computing_ahead(self, stop: Callable[[], bool] = lambda: False) -> ContextManager[None]:
        """Model calls inside run ahead of a step and keep their results (`TransformersPolicy`); `stop()` true
        before a call raises `AheadStopped`. By default nothing is kept (and `can_compute_ahead` is False)."""
        return contextlib.nullcontext()

    def reset_cache(self) -> None:
        """Forget cached prompt prefixes (an episode reset; results never depend on them). Default: none kept."""

    @property
    def constraint_note(self) -> str:
        """One line on how the steps' constraints were kept, where that is not a given (a model server: the form
        sent, how many answers fit the schema, or that decoding went free). Empty: nothing to say."""
        return ""


CAPABILITIES = ("inner", "supports_scoring", "can_compute_ahead", "computing_ahead", "reset_cache", "constraint_note")
"""The `Policy` members with defaults: what a wrapper must forward to the policy it wraps."""


NO_PROMPT_LOGPROBS = "this server returns no prompt logprobs: use --selector logprob or memory"
"""The one-line message when `score` is not available (the judge selector and `surprise` need it)."""


class RemoteCapabilityError(RuntimeError):
    """The model server cannot do what was asked (e.g. `score`: no prompt log-probabilities)."""


class AheadStopped(Exception):
    """Work ahead (`TransformersPolicy.computing_ahead`) stopped before a model call: told to, or a step
    someone waits for wants the model."""


class Timings:
    """Seconds spent per named phase, accumulated until `take()`: where a step's time goes
    (the step benchmark reads it; nothing else depends on it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def take(self) -> dict[str, float]:
        """The phases so far, and start again."""
        out, self.seconds = self.seconds, {}
        return out
