"""Start and stop `transformers serve` on the embedded model's converted checkpoint (tests and bench)."""
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
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"transformers-serve-{port}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}/v1"

    def answers() -> bool:
        if proc.poll() is not None:
            raise ServeError(f"transformers serve exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
        try:
            return httpx.get(f"{url}/models", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(answers, wait_s, interval=0.5)
    except AssertionError:
        stop(proc)
        raise ServeError(f"transformers serve did not answer in {wait_s:g} s: {log_path.read_text()[-2000:]}") from None
    return proc, url, log_path


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
