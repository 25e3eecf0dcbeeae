"""The two roles over an OpenAI-compatible HTTP server (vLLM, SGLang, TGI, llama.cpp, `transformers serve`).

Spec: `openai:<base_url>#<model>[?key=value&...]`, e.g.
`openai:http://localhost:8000/v1#Qwen/Qwen3-8B?tokenizer=hf:Qwen/Qwen3-8B`. Options:
`tokenizer` (`embedded`, `hf:<id or path>`, `none`), `prompt` (`auto`, `completions`, `chat`),
`timeout` (seconds per request), `retries` (attempts for 429/5xx/connection errors),
`backoff` (the first wait between attempts, doubling up to 8 s), `thinking` (`on`/`off`: the
chat template's `enable_thinking`, for Qwen3-style templates; unset: the template's default),
`do_sample` (`on`/`off`: send `generation_config={"do_sample": true}` with sampled requests;
`transformers serve` samples only when the model's generation config says so, and otherwise
answers every "sampled" candidate greedily; unset: on when `/v1/models` looks like `transformers serve`),
`context` (the context window in tokens), `concurrency` (requests in flight at once),
`constrain` (how a step's constraint travels: `auto`, the default, tries each form of
`spec.CONSTRAIN_FORMS` in turn; `lark`, `gbnf`, `json_schema` try only those; or one form; `off`).

Constraints. A step's constraint is sent as a grammar where the engine reads one: the llguidance
Lark grammar (`grammars.grammar_text`, the local decoder's own) to vLLM's guidance backend
(`structured_outputs.grammar`) and to SGLang's llguidance backend (`ebnf`, `%llguidance {}`
first), GBNF (`grammars.gbnf_text`) to llama.cpp's server and llama-cpp-python (`grammar`). A
grammar says everything a step asks: the call after a `<tool_call>` prefill, the response after
`<execution_result>`, and "a tagged call, or else text" (tool_choice auto). Else the JSON schema
(`structured_outputs.json`, `response_format`, `json_schema`), which cannot say "or else text":
such prompts are then sent free and counted. Each finished answer is checked against what was
asked (a plain-text answer where text is allowed is no evidence either way: free decoding writes
text too): servers answer HTTP 200 and ignore a field they do not know (vLLM since its `guided_json`
went in 0.12), so support is read from the output. Under `auto` (or a group) a form the server
refuses, or one an answer breaks, is dropped for the next; when none is left the model decodes
free, and `constraint_note` (the Run tab's model line, the eval report) says so.

How prompts travel. A Prompt may carry a prefill (the Rehearse role always starts its reply
with `<execution_result>`). Servers disagree on continuing an assistant message: vLLM and
SGLang take `continue_final_message`, `transformers serve` rejects unknown fields and always
opens a new assistant turn. What they all serve is the legacy `/v1/completions` endpoint with
a raw prompt, so when a local tokenizer with a chat template is known (the embedded model, a
served local directory, or `tokenizer=hf:...`) we render the chat template here, append the
prefill, and send text: the model reads exactly what the local backend would feed it
(`prompt=completions`). Without a tokenizer we fall back to `/v1/chat/completions`
(`prompt=chat`): the prefill goes as a trailing assistant message with
`continue_final_message` (vLLM, SGLang); a server that refuses those fields gets the plain
messages and the prefill is put back in front of its reply.

Capabilities are discovered from answers, not assumed: `n` (several samples in one request;
`transformers serve` and llama-cpp-python ignore it and answer one choice, llama.cpp's server
refuses it in some versions: the missing ones are sent as concurrent requests), `logprobs`
(kept asking only while the server returns them; llama-cpp-python without `logits_all` refuses
them), and prompt log-probabilities for `score` (`echo` + `logprobs` on `/v1/completions`).
Engines answer logprobs in different shapes, all read here: the completions shape
(`token_logprobs`, `tokens`, `text_offset`: vLLM, SGLang with offsets -1, llama-cpp-python) and
the chat shape (`content[{token, logprob}]`: llama.cpp's server, on /v1/completions too). vLLM,
SGLang and llama-cpp-python echo the prompt's logprobs; `transformers serve` and llama.cpp's
server do not: `score` then raises `RemoteCapabilityError` and the engine leaves `surprise` empty,
runs without tool relevance and refuses the `judge` selector.

`count_tokens` uses the local tokenizer when there is one, else an estimate of one token per
four characters (close for English and JSON with BPE vocabularies; prompts are then fitted
with that estimate, so leave headroom with `context=`).
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from tenacity import (RetryError, Retrying, retry_if_exception_type, stop_after_attempt,
                      wait_exponential_jitter)

from .base import (NO_PROMPT_LOGPROBS, Constraint, Generation, GenerationConfig, Policy, Prompt, RemoteCapabilityError,
                   derive_seed)
from .grammars import LLGUIDANCE_PREFIX, TEXT_PATTERN, gbnf_text, grammar_text
from .spec import (EMBEDDED_NAME, GRAMMAR_FORMS, RemoteOptions, constrain_forms, normalized_name,
                   parse_remote_target)

log = logging.getLogger(__name__)

API_KEY_ENVS = ("ENVACE_API_KEY", "OPENAI_API_KEY")
DEFAULT_CONTEXT_WINDOW = 8192
CHARS_PER_TOKEN = 4
"""The token estimate without a local tokenizer (BPE vocabularies average 3.5-4.5 chars/token on English and JSON)."""
_MODEL_ERRORS = ("does not exist", "not found", "not served", "pinned to", "unknown model", "no such model")
"""Words of a 4xx detail that mean the model name is wrong (vLLM, SGLang, TGI, transformers serve)."""
_MAX_STATS = 10_000
_UNSUPPORTED = ("not supported", "unsupported", "only no echo", "only one completion choice")
"""Words of an error that refuses a field for good, even with a 5xx (llama.cpp's server answers 500 for `echo`
and for `n` > 1 in some versions; llama-cpp-python answers 500 for `logprobs` without `logits_all`): not retried."""


class RemoteError(RuntimeError):
    """The server could not give an answer; the message is one line that says what to do."""


class RemoteUnavailableError(RemoteError):
    """Unreachable, or still failing (429/5xx/connection) after the bounded retries."""


class RemoteModelError(RemoteError):
    """The server does not serve the named model."""


class RemoteResponseError(RemoteError):
    """An answer that is not what the API promises: not JSON, no choices, no text."""


class _Retryable(Exception):
    """A failed attempt worth repeating (429, 5xx, connection error)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


# ---------------------------------------------------------------- spec


def api_key() -> str | None:
    import os

    for name in API_KEY_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return None


# ---------------------------------------------------------------- HTTP


@dataclass
class RequestStat:
    """One HTTP exchange, for the benchmark's account of where the time goes."""

    endpoint: str
    seconds: float
    """Round trip: network plus server (retries and their waits included)."""
    started: float = 0.0
    """`time.perf_counter()` when the request went out."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    attempts: int = 1


@dataclass
class _Caps:
    """What the server turned out to support (None: not yet known)."""

    n: bool | None = None
    logprobs: bool | None = None
    prompt_logprobs: bool | None = None
    continue_final: bool | None = None


@dataclass
class ConstraintRecord:
    """Whether this server kept the steps' JSON-schema constraints (one record per model: one policy per spec)."""

    form: str | None
    """The form constraints are sent in now (`spec.CONSTRAIN_FORMS`); None: decoding free."""
    counts: dict[str, list[int]] = field(default_factory=dict)
    """Per form: [finished constrained answers that fit the schema, that did not]."""
    free: int = 0
    """Constrained prompts sent without a constraint: a JSON schema cannot say "a call, or else text"."""
    dropped: list[str] = field(default_factory=list)
    """Forms the server refused or ignored, in the order they were dropped."""
    asked: bool = True
    """False where `constrain=off` asked for none."""

    @property
    def note(self) -> str:
        """One line for the model line and the report; empty before any constrained prompt."""
        held, broken = self.counts.get(self.form or "", [0, 0])
        free = f"; {self.free} text-or-call prompt(s) sent free" if self.free else ""
        if not self.asked:
            return "constraints off (constrain=off): decoding free"
        if self.form is None:
            return (f"constraints not kept by the server (it refused or ignored {', '.join(self.dropped)}): "
                    "decoding free, answers may not fit the schema") if self.dropped else ""
        if held + broken == 0:
            return f"constraints sent as {self.form}{free}" if self.free else ""
        return f"constraints sent as {self.form}: {held} of {held + broken} answer(s) fit the schema{free}"


class OpenAIPolicy(Policy):
    """`Policy` over an OpenAI-compatible server. Thread-safe; requests of one call go out concurrently."""

    def __init__(self, spec: str, options: RemoteOptions, transport: httpx.BaseTransport | None = None) -> None:
        self.name: str = spec
        self.options = options
        headers = {"Authorization": f"Bearer {api_key()}"} if api_key() else {}
        self._client = httpx.Client(base_url=options.base_url, headers=headers, transport=transport,
                                    timeout=httpx.Timeout(options.timeout, connect=options.connect_timeout))
        self._pool = ThreadPoolExecutor(max_workers=options.concurrency, thread_name_prefix="openai-policy")
        self.caps = _Caps()
        self.stats: list[RequestStat] = []
        self._stats_lock = threading.Lock()
        self._ready = False
        self._ready_lock = threading.Lock()
        self._server_context: int | None = None
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        forms = constrain_forms(options.constrain)
        first = forms[0] if forms else None
        self.constraints = ConstraintRecord(form=first, asked=options.constrain != "off")
        self._constraints_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OpenAIPolicy({self.name!r})"

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._client.close()

    # ------------------------------------------------------------ transport

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One call with bounded retries; the parsed JSON answer or a RemoteError."""
        url = f"{self.options.base_url}{path}"
        attempts = 0

        def once() -> httpx.Response:
            nonlocal attempts
            attempts += 1
            try:
                resp = self._client.request(method, path, json=body)
            except httpx.ReadTimeout:  # the server is generating, slowly: asking again would only queue more
                raise RemoteUnavailableError(f"{url} gave no answer within {self.options.timeout:g} s; a busy "
                                             "server or a long generation needs a larger ?timeout=") from None
            except httpx.TransportError as exc:  # refused, reset, connect timeout: worth another try
                raise _Retryable(f"cannot connect ({type(exc).__name__}: {exc})") from exc
            if (resp.status_code == 429 or resp.status_code >= 500) and not (
                    resp.status_code >= 500 and any(w in _detail(resp).lower() for w in _UNSUPPORTED)):
                raise _Retryable(f"HTTP {resp.status_code}: {_detail(resp)}", resp.status_code)
            return resp

        started = time.perf_counter()
        retrying = Retrying(
            retry=retry_if_exception_type(_Retryable), stop=stop_after_attempt(self.options.retries),
            wait=wait_exponential_jitter(initial=self.options.backoff, max=self.options.max_backoff), reraise=False)
        try:
            resp = retrying(once)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            status = getattr(last, "status", None)
            if status == 429:
                raise RemoteUnavailableError(
                    f"{url} kept answering 429 Too Many Requests ({attempts} attempts with backoff): lower K "
                    "or the request rate, or raise the server's limits") from None
            if status is None:
                raise RemoteUnavailableError(f"cannot reach {url} after {attempts} attempts: {last} "
                                             "(is the server running, and is the URL right?)") from None
            raise RemoteUnavailableError(f"{url} failed {attempts} times: {last}") from None
        seconds = time.perf_counter() - started
        if resp.status_code in (401, 403):
            raise RemoteError(f"{url} refused the request (HTTP {resp.status_code}): set ENVACE_API_KEY "
                              f"(or OPENAI_API_KEY) to the server's key: {_detail(resp)}")
        if resp.status_code >= 400:
            detail = _detail(resp)
            if resp.status_code == 404 or any(w in detail.lower() for w in _MODEL_ERRORS):
                raise RemoteModelError(f"{url}: HTTP {resp.status_code}: {detail}")
            raise RemoteError(f"{url}: HTTP {resp.status_code}: {detail}")
        try:
            data = resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RemoteResponseError(f"{url} answered with something that is not JSON: "
                                      f"{resp.text[:120]!r}") from None
        if not isinstance(data, dict):
            raise RemoteResponseError(f"{url} answered JSON that is not an object: {str(data)[:120]!r}")
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        with self._stats_lock:
            if len(self.stats) >= 2 * _MAX_STATS:  # a long UI session: keep the recent ones
                del self.stats[:_MAX_STATS]
            self.stats.append(RequestStat(path, seconds, started, usage.get("prompt_tokens"),
                                          usage.get("completion_tokens"), attempts))
        return data

    def check(self) -> None:
        """On first use: the server answers, and serves `model` (via /v1/models). Idempotent."""
        with self._ready_lock:
            if self._ready:
                return
            try:
                data = self._request("GET", "/models")
            except RemoteModelError:  # no /v1/models on this server (404): the first request will tell
                data = {}
            models = data.get("data") if isinstance(data.get("data"), list) else None
            if models is not None:
                ids = [str(m.get("id")) for m in models if isinstance(m, dict)]
                if self.options.model not in ids:
                    served = ", ".join(ids[:8]) or "nothing"
                    raise RemoteModelError(f"model {self.options.model!r} is not served at {self.options.base_url} "
                                           f"(it serves: {served})")
                for m in models:
                    if not isinstance(m, dict) or m.get("id") != self.options.model:
                        continue
                    if m.get("max_model_len"):
                        self._server_context = int(m["max_model_len"])  # vLLM says it
                    if self.options.do_sample is None and isinstance(m.get("status"), dict):
                        self.options.do_sample = True  # transformers serve lists {"status": {"value": "loaded"}}
            self._ready = True

    # ------------------------------------------------------------ tokenizer and prompts

    @property
    def tokenizer(self) -> Any:
        """The local tokenizer (for count_tokens and the chat template), or None."""
        if not self._tokenizer_loaded:
            with self._ready_lock:
                if not self._tokenizer_loaded:
                    self._tokenizer = _load_tokenizer(self.options)
                    self._tokenizer_loaded = True
        return self._tokenizer

    @property
    def prompt_mode(self) -> Literal["completions", "chat"]:
        if self.options.prompt != "auto":
            return self.options.prompt
        tok = self.tokenizer
        return "completions" if tok is not None and getattr(tok, "chat_template", None) else "chat"

    @property
    def context_window(self) -> int:
        if self.options.context:
            return self.options.context
        if self._server_context:
            return self._server_context
        tok = self.tokenizer
        limit = getattr(tok, "model_max_length", None) if tok is not None else None
        window = getattr(tok, "_envace_context", None) if tok is not None else None
        if window:
            return int(window)
        if isinstance(limit, int) and 0 < limit < 1_000_000:
            return limit
        return DEFAULT_CONTEXT_WINDOW

    def count_tokens(self, text: str) -> int:
        tok = self.tokenizer
        if tok is not None:
            return len(tok.encode(text, add_special_tokens=False))
        return math.ceil(len(text) / CHARS_PER_TOKEN)

    def render(self, prompt: Prompt) -> str:
        """The prompt as text (completions mode): the chat template with a generation prompt, then the prefill."""
        return prompt.render(self.tokenizer, **self._template_kwargs())

    def _template_kwargs(self) -> dict[str, Any]:
        return {} if self.options.thinking is None else {"enable_thinking": self.options.thinking}

    # ------------------------------------------------------------ generation

    def _body(self, prompt: Prompt, config: GenerationConfig, temperature: float, seed: int | None,
              n: int = 1) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {"model": self.options.model, "max_tokens": config.max_new_tokens,
                                "temperature": temperature}
        if temperature > 0:
            body["top_p"] = config.top_p
            if seed is not None:
                body["seed"] = seed
            if self.options.do_sample:
                body["generation_config"] = json.dumps({"do_sample": True})
        if config.stop:
            body["stop"] = list(config.stop)
        if n > 1:
            body["n"] = n
        if self.prompt_mode == "completions":
            body["prompt"] = self.render(prompt)
            if self.caps.logprobs is not False:
                body["logprobs"] = 1
            return "/completions", body
        messages = [dict(m) for m in prompt.messages]
        if prompt.prefill and self.caps.continue_final is not False:
            messages.append({"role": "assistant", "content": prompt.prefill})
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        body["messages"] = messages
        if self._template_kwargs():
            body["chat_template_kwargs"] = self._template_kwargs()  # vLLM, SGLang, transformers serve
        if self.caps.logprobs is not False:
            body["logprobs"] = True
        return "/chat/completions", body

    @property
    def constraint_note(self) -> str:
        return self.constraints.note

    @property
    def _forms(self) -> tuple[str, ...]:
        """The forms `constrain=` tries; one form is kept however its answers turn out (the user named it)."""
        forms = constrain_forms(self.options.constrain)
        return forms if len(forms) > 1 else ()

    def _constraint_form(self, prompt: Prompt) -> str | None:
        """The form to send `prompt.constraint` in, or None (none, none kept, or one a JSON schema cannot say)."""
        c = prompt.constraint
        form = self.constraints.form
        if c is None or form is None:
            return None
        if (c.allow_text or c.open.strip()) and form not in GRAMMAR_FORMS:
            with self._constraints_lock:  # "a call or else text" needs a grammar: sent free, and counted
                self.constraints.free += 1
            return None
        return form

    def _drop_form(self, form: str, why: str) -> None:
        """The server refused or ignored `form`: `auto` moves on to the next form, else decoding goes free."""
        with self._constraints_lock:
            record = self.constraints
            if record.form != form:
                return  # another request already moved on
            record.dropped.append(form)
            left = [f for f in self._forms if f not in record.dropped]
            record.form = left[0] if left else None
        log.warning("%s: constraints sent as %s were %s; %s", self.name, form, why,
                    f"trying {left[0]}" if left else "decoding free: answers may not fit the schema")

    def _check_constraint(self, gen: Generation, prompt: Prompt, form: str) -> bool:
        """Count whether a finished answer fits the schema it was constrained to; `auto` drops a form that did not.
        True when the form is no longer the one to send (the request is worth sending again)."""
        c = prompt.constraint
        if c is None or not gen.finished:
            return False  # cut off by the token budget: says nothing about the server
        body = gen.text[len(prompt.prefill):] if gen.text.startswith(prompt.prefill) else gen.text
        fits = _answer_fits(body, c)
        if fits is None:
            return False  # plain text: no evidence either way
        with self._constraints_lock:
            if self.constraints.form != form:
                return True
            self.constraints.counts.setdefault(form, [0, 0])[0 if fits else 1] += 1
        if not fits and self._forms:
            self._drop_form(form, f"ignored (an answer did not fit the schema: {body.strip()[:60]!r})")
            return True
        return False

    def _complete(self, prompt: Prompt, config: GenerationConfig, temperature: float, seed: int | None,
                  n: int = 1) -> list[Generation]:
        """One request; its choices as Generations (possibly fewer than `n`: the caller checks)."""
        self.check()
        form = self._constraint_form(prompt)
        path, body = self._body(prompt, config, temperature, seed, n)
        if form is not None:
            body.update(_constraint_fields(form, prompt.constraint))  # type: ignore[union-attr]
        try:
            data = self._request("POST", path, body)
        except RemoteError as exc:
            if form is not None and _mentions(exc, _CONSTRAINT_WORDS[form] + (
                    "schema", "grammar", "structured", "extra", "unexpected", "not permitted", "unknown field")):
                self._drop_form(form, f"refused ({exc})")
                return self._complete(prompt, config, temperature, seed, n)
            if "continue_final_message" in body and _mentions(exc, ("continue_final_message", "add_generation_prompt",
                                                                    "unexpected", "extra")):
                self.caps.continue_final = False  # e.g. transformers serve: 422 on unknown fields
                return self._complete(prompt, config, temperature, seed, n)
            if n > 1 and _mentions(exc, ("choice", "'n'", '"n"', " n ")):
                self.caps.n = False  # llama.cpp's server before n_cmpl: "Only one completion choice is allowed"
                return self._complete(prompt, config, temperature, seed)
            if "logprobs" in body and self.caps.logprobs is None and _mentions(exc, ("logprobs", "logits_all")):
                self.caps.logprobs = False  # llama-cpp-python without logits_all: 500 for any `logprobs`
                log.warning("%s: the server refuses logprobs (%s); decoding without them", self.name, exc)
                return self._complete(prompt, config, temperature, seed, n)
            raise
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices:
            raise RemoteResponseError(f"{self.options.base_url}{path} answered with no choices: {str(data)[:160]!r}")
        if "continue_final_message" in body:
            self.caps.continue_final = True
        out = []
        for choice in sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0):
            out.append(self._generation(choice, prompt.prefill, config.stop, path, "logprobs" in body,
                                        prefilled="continue_final_message" in body or path == "/completions"))
        moved_on = False
        for gen in out:
            gen.sampled = temperature > 0
            if form is not None:
                moved_on = self._check_constraint(gen, prompt, form) or moved_on
        if moved_on:  # the server ignored this form: ask again in the next one (or free, which stops here)
            return self._complete(prompt, config, temperature, seed, n)
        return out

    def _generation(self, choice: Any, prefill: str, stop: tuple[str, ...], path: str, asked_logprobs: bool,
                    prefilled: bool) -> Generation:
        if not isinstance(choice, dict):
            raise RemoteResponseError(f"{path}: a choice that is not an object: {str(choice)[:120]!r}")
        if path == "/completions":
            text = choice.get("text")
        else:
            message = choice.get("message")
            if not isinstance(message, dict):
                raise RemoteResponseError(f"{path}: a choice without a message: {str(choice)[:120]!r}")
            text = message.get("content") or ""
            text += "".join(_tool_call_text(tc) for tc in message.get("tool_calls") or [])
        if not isinstance(text, str):
            raise RemoteResponseError(f"{path}: a choice without text: {str(choice)[:120]!r}")
        lps = _token_logprobs(choice.get("logprobs"))
        if asked_logprobs and self.caps.logprobs is None:
            self.caps.logprobs = lps is not None
        if prefilled:
            text = prefill + text
        elif prefill and not text.lstrip().startswith(prefill):
            text = prefill + text  # the server could not continue our prefill: put it back in front
        text, cut = _apply_stop(text, stop, choice, prefill)
        finish = choice.get("finish_reason")
        return Generation(text=text, token_logprobs=lps or [], finished=finish != "length" or cut)

    def act(self, prompt: Prompt, k: int, config: GenerationConfig) -> list[Generation]:
        """K candidates: index 0 at temperature 0; 1..K-1 sampled, in one `n` request where the server allows."""
        if k < 1:
            return []
        greedy = self._pool.submit(self._complete, prompt, config, 0.0, None)
        samples: list[Generation] = []
        if k > 1:
            if self.caps.n is not False:
                first = self._complete(prompt, config, config.temperature, _seed(config.seed, 1), n=k - 1)
                if k > 2:
                    self.caps.n = len(first) >= k - 1
                samples = first[: k - 1]
            missing = range(len(samples) + 1, k)
            futures = [self._pool.submit(self._complete, prompt, config, config.temperature,
                                         _seed(config.seed, i)) for i in missing]
            samples += [f.result()[0] for f in futures]
        return [greedy.result()[0], *samples]

    def act_each(self, prompts: list[Prompt], config: GenerationConfig) -> list[Generation]:
        """One greedy candidate per prompt, sent concurrently (as `rehearse`)."""
        return self.rehearse(prompts, config)

    def rehearse(self, prompts: list[Prompt], config: GenerationConfig) -> list[Generation]:
        """One greedy prediction per prompt, sent concurrently (the server batches them)."""
        futures = [self._pool.submit(self._complete, p, config, 0.0, None) for p in prompts]
        return [f.result()[0] for f in futures]

    # ------------------------------------------------------------ scoring

    @property
    def supports_scoring(self) -> bool:
        """Whether `score` works here: probed once with a tiny echo request."""
        if self.caps.prompt_logprobs is None:
            if self.prompt_mode != "completions":
                self.caps.prompt_logprobs = False
            else:
                try:
                    self._score_one("Hello", " world")
                except RemoteCapabilityError:
                    pass
                except RemoteError as exc:  # e.g. a 400 for `echo`: no prompt logprobs either
                    log.warning("prompt log-probabilities probe failed: %s", exc)
                    self.caps.prompt_logprobs = False
        return bool(self.caps.prompt_logprobs)

    def _score_one(self, prefix: str, continuation: str) -> list[float]:
        self.check()
        full = prefix + continuation
        body = {"model": self.options.model, "prompt": full, "echo": True, "logprobs": 1, "max_tokens": 1,
                "temperature": 0.0}
        data = self._request("POST", "/completions", body)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise RemoteResponseError(f"{self.options.base_url}/completions answered with no choices")
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        values = _echoed_logprobs(choices[0], full, len(prefix), usage.get("completion_tokens"))
        if values is None:
            self.caps.prompt_logprobs = False
            raise RemoteCapabilityError(NO_PROMPT_LOGPROBS)
        self.caps.prompt_logprobs = True
        return values

    def score(self, prompts: list[Prompt], continuations: list[str]) -> list[list[float]]:
        """Per-token log-probabilities of each continuation (`echo` + `logprobs` on /v1/completions)."""
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        if not prompts:
            return []
        if self.caps.prompt_logprobs is False or self.prompt_mode != "completions":
            self.caps.prompt_logprobs = False
            raise RemoteCapabilityError(NO_PROMPT_LOGPROBS)
        futures = [self._pool.submit(self._score_one, self.render(p), c) for p, c in zip(prompts, continuations)]
        return [f.result() for f in futures]


# ---------------------------------------------------------------- helpers


def _seed(seed: int, row: int) -> int:
    """The local backend's per-row seed, in the 31 bits every server accepts."""
    return derive_seed(seed, row) % (2**31 - 1)


def _detail(resp: httpx.Response) -> str:
    """The server's error message, one line."""
    try:
        data = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return " ".join(resp.text.split())[:200] or resp.reason_phrase
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message", data)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return " ".join(str(err).split())[:200]
    return " ".join(str(data).split())[:200]


def _mentions(exc: Exception, words: tuple[str, ...]) -> bool:
    text = str(exc).lower()
    return any(w in text for w in words)


def _tool_call_text(tool_call: Any) -> str:
    """A server-parsed tool call (vLLM --enable-auto-tool-choice) back into the `<tool_call>` text we parse."""
    fn = tool_call.get("function") if isinstance(tool_call, dict) else None
    if not isinstance(fn, dict):
        return ""
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return "<tool_call>" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + "</tool_call>"


_CONSTRAINT_WORDS = {"vllm": ("structured_outputs",), "openai": ("response_format", "json_schema"),
                     "llama.cpp": ("json_schema",), "sglang": ("json_schema",),
                     "vllm-lark": ("structured_outputs", "lark"), "sglang-lark": ("ebnf",), "gbnf": ("gbnf",)}
"""Words of an error that refuses a constraint form (with the generic ones in `_complete`)."""


def _constraint_fields(form: str, constraint: Constraint) -> dict[str, Any]:
    """The request fields that carry `constraint` in `form` (`spec.CONSTRAIN_FORMS`)."""
    schema = constraint.schema
    if form == "vllm-lark":
        return {"structured_outputs": {"grammar": grammar_text(constraint)}}
    if form == "sglang-lark":
        return {"ebnf": LLGUIDANCE_PREFIX + grammar_text(constraint)}
    if form == "gbnf":
        return {"grammar": gbnf_text(constraint)}
    if form == "vllm":
        return {"structured_outputs": {"json": schema}}
    if form == "openai":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "step", "schema": schema}}}
    if form == "llama.cpp":
        return {"json_schema": schema}
    return {"json_schema": json.dumps(schema)}  # sglang: a JSON string


def _answer_fits(body: str, constraint: Constraint) -> bool | None:
    """Whether the generated text (after the prefill) is what `constraint` allows: `open + JSON + close` with the JSON
    valid under the schema. None for a plain-text answer where text is allowed (`allow_text`) and it does not start
    like a call: a model decoding free writes such text too, so it says nothing about whether the server kept the
    grammar (counted, a server that ignored it looked as if it kept it: a real llama-cpp-python did)."""
    if constraint.open and body.startswith(constraint.open):
        body = body[len(constraint.open):]
    elif constraint.allow_text:
        return None if TEXT_PATTERN.fullmatch(body) is not None else False
    if constraint.close and body.rstrip().endswith(constraint.close):
        body = body.rstrip()[: -len(constraint.close)]
    return _fits(body, constraint.schema)


def _fits(body: str, schema: dict[str, Any]) -> bool:
    """`body` is one JSON value valid under `schema`."""
    import jsonschema

    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return False
    try:
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    except jsonschema.SchemaError:
        return True  # a schema the validator cannot read: the server's grammar was the judge


def _token_logprobs(logprobs: Any) -> list[float] | None:
    """The generated tokens' log-probabilities, from either shape an engine answers with: the completions shape
    (`token_logprobs`: vLLM, SGLang, llama-cpp-python) or the chat shape (`content[{token, logprob, top_logprobs}]`:
    every chat endpoint, and llama.cpp's server on /v1/completions too). None: the answer has none."""
    if not isinstance(logprobs, dict):
        return None
    values = logprobs.get("token_logprobs")
    if isinstance(values, list):
        return [float(v) for v in values if _is_number(v)]
    content = logprobs.get("content")
    if isinstance(content, list):
        return [float(t["logprob"]) for t in content if isinstance(t, dict) and _is_number(t.get("logprob"))]
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _echoed_logprobs(choice: dict[str, Any], full: str, start: int, generated: Any) -> list[float] | None:
    """Log-probabilities of the tokens of `full[start:]` in an `echo` + `logprobs` answer (each token that overlaps
    it, one straddling the boundary too), or None where the answer holds none for the prompt.

    Where a token is in the text is read from `text_offset` when every offset used agrees with the text (vLLM,
    llama-cpp-python). Otherwise (SGLang writes -1, "not supported yet"; a BOS token's text counted in the
    offsets) it is counted back from the end of the prompt over the prompt's tokens: all but the last `generated`
    (the answer's `usage.completion_tokens`; 1, the one token asked for, when it does not say). An answer whose
    logprobs cover only the generated tokens (llama.cpp's server, which echoes the text but not its logprobs)
    holds none for the prompt."""
    lp, text = choice.get("logprobs"), choice.get("text")
    if not isinstance(lp, dict) or not isinstance(text, str) or not text.startswith(full):
        return None
    tokens, values, offsets = lp.get("tokens"), lp.get("token_logprobs"), lp.get("text_offset")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values) \
            or not all(isinstance(t, str) for t in tokens):
        return None
    end = len(full)
    if isinstance(offsets, list) and len(offsets) == len(tokens) and all(_is_number(o) and o >= 0 for o in offsets):
        spans = [(int(o), int(o) + len(t)) for o, t in zip(offsets, tokens)]
        used = [i for i, (a, b) in enumerate(spans) if b > start and a < end]
        if used and all(text.startswith(tokens[i], spans[i][0]) for i in used):
            return [float(values[i]) for i in used if _is_number(values[i])]
    n_gen = generated if isinstance(generated, int) and 0 <= generated <= len(tokens) else 1
    prompt_tokens = tokens[: len(tokens) - n_gen]
    out: list[float] = []
    pos = end
    for i in range(len(prompt_tokens) - 1, -1, -1):
        if pos <= start:
            break
        if _is_number(values[i]):
            out.append(float(values[i]))
        pos -= len(prompt_tokens[i])
    if pos > start or not out:
        return None  # the prompt's tokens do not reach back over the continuation
    return out[::-1]


def _apply_stop(text: str, stop: tuple[str, ...], choice: dict[str, Any], prefill: str) -> tuple[str, bool]:
    """Text up to and including the first stop string, as the local backend returns it.

    OpenAI servers drop the stop string (vLLM says which in `stop_reason`); `transformers serve`
    keeps it. A `</x>` stop with an unclosed `<x>` in the text was dropped: put it back.
    Returns (text, whether a stop string ended it).
    """
    body_start = len(prefill)
    first = None
    for s in stop:
        pos = text.find(s, body_start)
        if pos >= 0 and (first is None or pos < first[0]):
            first = (pos, s)
    if first is not None:
        return text[: first[0] + len(first[1])], True
    if choice.get("finish_reason") != "stop":
        return text, False
    reason = choice.get("stop_reason")
    if isinstance(reason, str) and reason in stop:
        return text + reason, True
    for s in stop:
        if s.startswith("</") and text.count("<" + s[2:]) > text.count(s):
            return text + s, True
    return text, False


def _load_tokenizer(options: RemoteOptions) -> Any:
    """The tokenizer named by `tokenizer=`, or guessed: a served local directory, the embedded model's name."""
    from .loading import MissingModelError, load_tokenizer  # transformers: only with a local tokenizer

    choice = options.tokenizer
    if choice is None and normalized_name(options.model) == normalized_name(EMBEDDED_NAME):
        choice = "embedded"
    elif choice is None and Path(options.model).expanduser().is_dir():
        choice = f"hf:{Path(options.model).expanduser()}"  # a server on this machine serving a local directory
    if choice in (None, "none"):
        log.info("no local tokenizer for %s: counting tokens as characters / %d", options.model, CHARS_PER_TOKEN)
        return None
    try:
        tok, window = load_tokenizer(choice)
    except MissingModelError as exc:
        raise RemoteError(str(exc)) from None
    tok._envace_context = window
    return tok


def load_remote_policy(spec: str, target: str) -> OpenAIPolicy:
    """An `OpenAIPolicy` for `openai:<target>`, checked against the server (it answers, it serves the model)."""
    policy = OpenAIPolicy(spec, parse_remote_target(target))
    policy.check()
    return policy


__all__ = ["OpenAIPolicy", "RemoteCapabilityError", "RemoteError", "RemoteModelError", "RemoteOptions",
           "RemoteResponseError", "RemoteUnavailableError", "RequestStat", "load_remote_policy",
           "parse_remote_target"]
