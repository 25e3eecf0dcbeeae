"""Model specs: the strings that name a model (`embedded`, `hf:`, `gguf:`, `openai:`), parsed.

No torch, no httpx: the CLI validates a spec before anything heavy loads. `loading` turns a
local spec into weights, `remote` an `openai:` spec into a client, `factory` picks between them.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
VALID_SPECS = "embedded, hf:<hub id or local path>, gguf:<path to .gguf>, openai:<base_url>#<model>"
CACHE_ENV = "ENVACE_CACHE_DIR"
REMOTE_OPTIONS = ("tokenizer", "prompt", "thinking", "do_sample", "timeout", "retries", "backoff", "context", "concurrency",
                  "constrain")
CONSTRAIN_FORMS = ("vllm-lark", "sglang-lark", "gbnf", "vllm", "openai", "llama.cpp", "sglang")
"""How a step's constraint travels, by the engine that reads it. Grammars, which also say "a call, or else text":
`vllm-lark` (vLLM's `structured_outputs.grammar`, Lark read by its guidance backend), `sglang-lark` (SGLang's `ebnf`
with the `%llguidance {}` prefix, read by its llguidance backend), `gbnf` (the `grammar` field of llama.cpp's server
and llama-cpp-python). JSON schemas: vLLM's `structured_outputs.json`, OpenAI's `response_format` json_schema (vLLM,
SGLang, llama.cpp's chat endpoint), llama.cpp's `json_schema` object, SGLang's `json_schema` string. `auto` tries
them in this order."""
CONSTRAIN_GROUPS = {"lark": ("vllm-lark", "sglang-lark"), "gbnf": ("gbnf",),
                    "json_schema": ("vllm", "openai", "llama.cpp", "sglang")}
"""`constrain=` values that name a kind of form: its forms, tried in this order."""
GRAMMAR_FORMS = CONSTRAIN_GROUPS["lark"] + CONSTRAIN_GROUPS["gbnf"]
CONSTRAIN_CHOICES = ("auto", "off", *CONSTRAIN_GROUPS, *CONSTRAIN_FORMS)


def constrain_forms(choice: str) -> tuple[str, ...]:
    """The forms a `constrain=` value tries, in order (none for `off`)."""
    if choice == "auto":
        return CONSTRAIN_FORMS
    if choice == "off":
        return ()
    return CONSTRAIN_GROUPS.get(choice, (choice,))



def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where converted checkpoints (and the native step's build) live: argument, then $ENVACE_CACHE_DIR, then
    ~/.cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path.home() / ".cache" / "envace-inspector" / "models"


class ModelSpecError(ValueError):
    """A model spec that is not one of the valid forms."""


@dataclass(frozen=True)
class ModelSpec:
    kind: Literal["embedded", "hf", "gguf", "openai"]
    target: str
    """Hub id or path for `hf`, file path for `gguf`, `<base_url>#<model>[?options]` for `openai`, empty for `embedded`."""


@dataclass
class RemoteOptions:
    """What an `openai:` spec says."""

    base_url: str
    """Up to and including the API version, e.g. `http://localhost:8000/v1`."""
    model: str
    """The name the server knows the model by (`/v1/models`)."""
    tokenizer: str | None = None
    """`embedded`, `hf:<id or path>`, `none`; None: guess (a local directory, or the embedded model's name)."""
    prompt: Literal["auto", "completions", "chat"] = "auto"
    thinking: bool | None = None
    """`enable_thinking` for the chat template (Qwen3 thinks by default and spends the action budget on it)."""
    do_sample: bool | None = None
    """Send `generation_config` with `do_sample` on sampled requests (`transformers serve`); None: detect."""
    timeout: float = 120.0
    """Seconds for one request to answer (a long generation on a busy server takes a while)."""
    connect_timeout: float = 5.0
    retries: int = 5
    """Attempts per request for 429, 5xx and connection errors (exponential backoff with jitter)."""
    backoff: float = 0.5
    """First wait in seconds; doubles each attempt, at most `max_backoff`."""
    max_backoff: float = 8.0
    context: int | None = None
    concurrency: int = 8
    constrain: str = "auto"
    """`auto` (each form of `CONSTRAIN_FORMS` in turn, kept while the answers fit the schema), a group of
    `CONSTRAIN_GROUPS` (its forms in turn), one form, or `off`."""


def parse_remote_target(target: str) -> RemoteOptions:
    """`<base_url>#<model>[?opts]` -> RemoteOptions; ValueError with a one-line reason."""
    url, sep, rest = target.strip().partition("#")
    if not sep or not rest.strip():
        raise ValueError("an openai: spec needs the model after '#': openai:<base_url>#<model>")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{url!r} is not an http(s) URL")
    model, _, query = rest.partition("?")
    if not model.strip():
        raise ValueError("an openai: spec needs the model after '#': openai:<base_url>#<model>")
    base = url.rstrip("/")
    if parts.path in ("", "/"):
        base += "/v1"  # the usual mount point (vLLM, SGLang, TGI, llama.cpp, transformers serve)
    opts = RemoteOptions(base_url=base, model=model.strip())
    for item in filter(None, query.split("&")):
        key, _, value = item.partition("=")
        if key not in REMOTE_OPTIONS or not value:
            raise ValueError(f"unknown option {item!r} in the openai: spec; options: {', '.join(REMOTE_OPTIONS)}")
        try:
            if key == "tokenizer":
                if value not in ("embedded", "none") and not value.startswith("hf:"):
                    raise ValueError
                opts.tokenizer = value
            elif key in ("thinking", "do_sample"):
                if value not in ("on", "off"):
                    raise ValueError
                setattr(opts, key, value == "on")
            elif key == "prompt":
                if value not in ("auto", "completions", "chat"):
                    raise ValueError
                opts.prompt = value  # type: ignore[assignment]
            elif key == "timeout":
                opts.timeout = float(value)
            elif key == "retries":
                opts.retries = max(1, int(value))
            elif key == "backoff":
                opts.backoff = float(value)
            elif key == "context":
                opts.context = int(value)
            elif key == "concurrency":
                opts.concurrency = max(1, int(value))
            elif key == "constrain":
                if value not in CONSTRAIN_CHOICES:
                    raise ValueError
                opts.constrain = value
        except ValueError:
            choices = {"constrain": f" ({', '.join(CONSTRAIN_CHOICES)})"}.get(key, "")
            raise ValueError(f"bad value for {key} in the openai: spec: {value!r}{choices}") from None
    return opts


def parse_spec(spec: str) -> ModelSpec:
    """Split a spec string; raise `ModelSpecError` naming the valid forms."""
    spec = spec.strip()
    if spec == "embedded":
        return ModelSpec("embedded", "")
    kind, sep, target = spec.partition(":")
    if sep and kind in ("hf", "gguf") and target.strip():
        return ModelSpec(kind, target.strip())  # type: ignore[arg-type]
    if sep and kind == "openai":
        try:
            parse_remote_target(target)
        except ValueError as exc:
            raise ModelSpecError(f"bad model spec {spec!r}: {exc}; valid forms: {VALID_SPECS}") from None
        return ModelSpec("openai", target.strip())
    raise ModelSpecError(f"unknown model spec {spec!r}; valid forms: {VALID_SPECS}")


def normalized_name(name: str) -> str:
    """`/x/SmolLM2-135M-Instruct.Q4_1.gguf` -> `smollm2-135m-instruct`."""
    base = name.rstrip("/").rsplit("/", 1)[-1].lower()
    base = re.sub(r"\.gguf$", "", base)
    return re.sub(r"[.\-_](q\d\w*|f16|f32|bf16)$", "", base)
