"""Answers of /v1/completions in each serving engine's shape, for the fake server to replay.

Each builder writes the JSON an engine's source writes for the same request (the source is named
on each), over a stand-in tokenization: the text in `CHUNK`-character pieces, a piece starting
where the continuation to score starts, and token i's log-probability `-(i + 1) / 10`. A test
computes what `score` must return from the same pieces, independently of the code under test.
"""
from __future__ import annotations

from typing import Any

CHUNK = 4
GENERATED = "!"
"""The one token an `echo` request with `max_tokens: 1` generates."""


def pieces(text: str) -> list[str]:
    return [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)]


def tokenize(prompt: str, continuation: str) -> list[str]:
    """The prompt's tokens: the prefix's pieces, then the continuation's."""
    prefix = prompt[: len(prompt) - len(continuation)] if continuation and prompt.endswith(continuation) else prompt
    return pieces(prefix) + (pieces(continuation) if prefix != prompt else [])


def logprob(i: int) -> float:
    return -(i + 1) / 10


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    out, pos = [], start
    for tok in tokens:
        out.append(pos)
        pos += len(tok)
    return out


def vllm_echo(prompt: str, continuation: str, bos: str = "") -> dict[str, Any]:
    """vLLM (`vllm/entrypoints/openai/serving_completion.py`, `_create_completion_logprobs`): the prompt's tokens
    then the generated one; the first logprob is None; `text_offset` counts every token's text from 0, a BOS
    token's too (then the offsets run ahead of the echoed text by its length)."""
    tokens = ([bos] if bos else []) + tokenize(prompt, continuation) + [GENERATED]
    values: list[float | None] = [logprob(i) for i in range(len(tokens))]
    values[0] = None
    return {"object": "text_completion", "model": "fake", "choices": [{
        "index": 0, "text": prompt + GENERATED, "finish_reason": "length", "stop_reason": None,
        "logprobs": {"text_offset": _offsets(tokens), "token_logprobs": values, "tokens": tokens,
                     "top_logprobs": [None] + [{t: v} for t, v in zip(tokens[1:], values[1:])]}}],
        "usage": {"prompt_tokens": len(tokens) - 1, "completion_tokens": 1, "total_tokens": len(tokens)}}


def sglang_echo(prompt: str, continuation: str, bos: str = "") -> dict[str, Any]:
    """SGLang (`python/sglang/srt/entrypoints/openai/utils.py`, `to_openai_style_logprobs`): input then output
    token logprobs (`logprob_start_len` 0 under `echo`), the first None, and every `text_offset` -1
    ("Not supported yet")."""
    tokens = ([bos] if bos else []) + tokenize(prompt, continuation) + [GENERATED]
    values: list[float | None] = [logprob(i) for i in range(len(tokens))]
    values[0] = None
    return {"object": "text_completion", "model": "fake", "choices": [{
        "index": 0, "text": prompt + GENERATED, "finish_reason": "length", "matched_stop": None,
        "logprobs": {"text_offset": [-1] * len(tokens), "token_logprobs": values, "tokens": tokens,
                     "top_logprobs": []}}],
        "usage": {"prompt_tokens": len(tokens) - 1, "completion_tokens": 1, "total_tokens": len(tokens)}}


def llama_cpp_python_echo(prompt: str, continuation: str) -> dict[str, Any]:
    """llama-cpp-python (`llama_cpp/llama.py`, `Llama._create_completion`, server default `logits_all=True`): the
    BOS token is dropped, `text_offset` is the detokenized length before each token, and the first token's
    logprob and top_logprobs are None ("weird idiosyncrasy of the OpenAI API")."""
    tokens = tokenize(prompt, continuation) + [GENERATED]
    values: list[float | None] = [logprob(i) for i in range(len(tokens))]
    values[0] = None
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "fake", "choices": [{
        "text": prompt + GENERATED, "index": 0, "finish_reason": "length",
        "logprobs": {"tokens": tokens, "text_offset": _offsets(tokens), "token_logprobs": values,
                     "top_logprobs": [None] + [{t: v} for t, v in zip(tokens[1:], values[1:])]}}],
        "usage": {"prompt_tokens": len(tokens), "completion_tokens": 1, "total_tokens": len(tokens) + 1}}


def llama_cpp_new_echo(prompt: str) -> dict[str, Any]:
    """llama.cpp's server where it takes `echo` (`tools/server/server-task.cpp`, `to_json_oaicompat` with
    `probs_vector_to_json_oaicompat_completions`): the text starts with the prompt, but the logprobs are the
    generated tokens' only, offsets from 0. No prompt log-probabilities."""
    return {"object": "text_completion", "model": "fake", "choices": [{
        "text": prompt + GENERATED, "index": 0, "finish_reason": "length",
        "logprobs": {"tokens": [GENERATED], "token_logprobs": [-0.5], "top_logprobs": [{GENERATED: -0.5}],
                     "text_offset": [0]}}],
        "usage": {"completion_tokens": 1, "prompt_tokens": 9, "total_tokens": 10}}


LLAMA_CPP_NO_ECHO = (500, {"error": {"code": 500, "message": "Only no echo is supported", "type": "server_error"}})
"""llama.cpp's server (`tools/server/server-common.cpp`, `oaicompat_completion_params_parse`): `echo` throws, and
the exception handler answers 500 in the OpenAI error shape."""
LLAMA_CPP_ONE_CHOICE = (500, {"error": {"code": 500, "message": "Only one completion choice is allowed",
                                        "type": "server_error"}})
"""llama.cpp's server before `n_cmpl`: `n` other than 1 throws."""
LLAMA_CPP_PYTHON_NO_LOGITS = (500, {"error": {
    "message": "logprobs is not supported for models created with logits_all=False", "type": "internal_server_error",
    "param": None, "code": None}})
"""llama-cpp-python started with `--logits_all false`: `_create_completion` raises ValueError for any `logprobs`,
and the server's error wrapper answers 500 (`llama_cpp/server/errors.py`)."""


def generation(engine: str, text: str, values: list[float]) -> dict[str, Any]:
    """A /v1/completions answer generating `text` as len(values) tokens, in `engine`'s logprobs shape."""
    tokens = [text[i * len(text) // len(values):(i + 1) * len(text) // len(values)] for i in range(len(values))]
    if engine == "llama.cpp":  # chat-shaped logprobs on /v1/completions (server-task.cpp, probs_vector_to_json)
        logprobs: dict[str, Any] = {"content": [
            {"id": 100 + i, "token": t, "bytes": list(t.encode()), "logprob": v,
             "top_logprobs": [{"id": 100 + i, "token": t, "bytes": list(t.encode()), "logprob": v}]}
            for i, (t, v) in enumerate(zip(tokens, values))]}
    elif engine == "sglang":
        logprobs = {"text_offset": [-1] * len(tokens), "token_logprobs": values, "tokens": tokens, "top_logprobs": []}
    else:  # vllm, llama-cpp-python: the OpenAI completions shape
        logprobs = {"text_offset": _offsets(tokens, 1000), "token_logprobs": values, "tokens": tokens,
                    "top_logprobs": [{t: v} for t, v in zip(tokens, values)]}
    return {"object": "text_completion", "model": "fake", "choices": [
        {"index": 0, "text": text, "finish_reason": "stop", "logprobs": logprobs}],
        "usage": {"prompt_tokens": 10, "completion_tokens": len(values)}}
