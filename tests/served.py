"""Start and stop `transformers serve` on the embedded model's converted checkpoint, and llama-cpp-python's server on
its GGUF file (tests and bench)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from helpers import free_port, wait_until


class ServeError(RuntimeError):
    """The server exited or did not answer in time (the message holds the end of its log)."""


def embedded_checkpoint() -> Path:
    """The safetensors directory `load_policy("embedded")` reads (converted once when missing)."""
    from model_backend.loading import convert_gguf, embedded_gguf_path, gguf_cache_dir, is_converted

    ckpt = gguf_cache_dir(embedded_gguf_path())
    if not is_converted(ckpt):
        convert_gguf(embedded_gguf_path(), ckpt)
    return ckpt


def start(ckpt: Path, wait_s: float = 240) -> tuple[subprocess.Popen, str, Path]:
    """(process, base URL, log file) once `/v1/models` answers; ServeError otherwise (the process is stopped)."""
    port = free_port()
    cmd = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(ckpt), "--host", "127.0.0.1",
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--log-level", "error"]
    return _start(cmd, port, "transformers-serve", wait_s)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def start_llama_cpp(python: str | Path, gguf: Path, model: str, wait_s: float = 240,
                    threads: int = 2) -> tuple[subprocess.Popen, str, Path]:
    """llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, in its own environment `python`) on `gguf`,
    listed as `model`: (process, base URL, log file) once `/v1/models` answers; ServeError otherwise. `logits_all`
    (its default) keeps every position's logits: the generated tokens' and the echoed prompt's logprobs."""
    port = free_port()
    cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", model, "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "8192", "--n_threads", str(threads), "--n_threads_batch", str(threads),
           "--logits_all", "true"]
    return _start(cmd, port, "llama-cpp-python", wait_s)


def _start(cmd: list[str], port: int, name: str, wait_s: float) -> tuple[subprocess.Popen, str, Path]:
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-{port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}/v1"

    def answers() -> bool:
        if proc.poll() is not None:
            raise ServeError(f"{name} exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
        try:
            return httpx.get(f"{url}/models", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(answers, wait_s, interval=0.5)
    except AssertionError:
        stop(proc)
        raise ServeError(f"{name} did not answer in {wait_s:g} s: {log_path.read_text()[-2000:]}") from None
    return proc, url, log_path
