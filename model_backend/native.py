"""The native decode step: `native_decode.c`, compiled here at first use and called through ctypes.

At batch 1 the lean torch step spends more time on about 1,000 small ops a token (and on taking the GIL
back after each) than on reading the weights. The C file computes a layer for the new tokens of a step in
three calls (before attention, attention, after attention), a decode step's layers all in one, and the head
in one, with fp16 weights widened exactly to fp32 as fbgemm does; `fast_step.lean_step` uses it for steps
of fp16 models with at most `fast_step.NATIVE_STEP_MAX_TOKENS` real tokens (decode steps, jump-forward's
forced tokens, short rows after a shared prefix) and keeps torch for everything else (prefill, token trees,
fp32 weights).

It needs a C compiler (`cc`, with OpenMP) and an x86-64 CPU with AVX2, FMA and F16C. Where either is
missing, or `ENVACE_NATIVE=0`, `library()` returns None and the torch step runs as before; `status()`
says why. The shared library is cached under the models' cache root, keyed by the source and the CPU.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .spec import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_decode.c")
ENV = "ENVACE_NATIVE"
"""Set to 0 to keep the torch decode step."""
CPU_FLAGS = ("avx2", "fma", "f16c")
FLAGS = ["-O3", "-march=native", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c11"]

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_status: str | None = None
_wanted = True


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _declare(lib: ctypes.CDLL) -> None:
    i, f, p, L = ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_long
    lib.envace_pre_attention.argtypes = [i, i, i, i, i, p, p, f, p, p, p, p, p, p, p]
    lib.envace_attention.argtypes = [i, i, i, i, p, p, p, L, i, p, p, L, L, i, p, p, p, f, p]
    lib.envace_post_attention.argtypes = [i, i, i, p, p, p, p, f, p, p, p]
    lib.envace_head.argtypes = [i, i, i, p, p, f, p, p, p]
    lib.envace_gemm.argtypes = [i, i, i, p, p, p]
    lib.envace_decode_layers.argtypes = [i, i, i, i, i, i, i, p, p, p, p, p, p, L, i, L, L, i, p, f, p, p, p, p, p]
    for fn in (lib.envace_pre_attention, lib.envace_attention, lib.envace_post_attention, lib.envace_head,
               lib.envace_gemm, lib.envace_decode_layers):
        fn.restype = None


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: another process may be building the same file


def use(wanted: bool) -> None:
    """Turn the native step on or off for this process (benchmarks compare both; `ENVACE_NATIVE=0` is the
    setting's environment form). Decode steps made after the call follow it."""
    global _wanted
    _wanted = wanted


def library() -> ctypes.CDLL | None:
    """The compiled native step, or None where it cannot run here or is turned off (see `status`)."""
    global _library, _status
    if not _wanted:
        return None
    with _lock:
        if _library is not None or _status is not None:
            return _library
        if os.environ.get(ENV, "1").strip() == "0":
            _status = f"off (${ENV}=0)"
            return None
        if platform.machine().lower() not in ("x86_64", "amd64"):
            _status = f"not built: {platform.machine()} is not x86-64"
            return None
        missing = [flag for flag in CPU_FLAGS if flag not in _cpu_flags()]
        if missing:
            _status = f"not built: the CPU lacks {', '.join(missing)}"
            return None
        source = SOURCE.read_bytes()
        key = hashlib.sha1(source + " ".join(FLAGS).encode() + platform.processor().encode()
                           + " ".join(sorted(_cpu_flags())).encode()).hexdigest()[:16]
        target = cache_root() / "native-decode" / f"envace_decode-{key}.so"
        try:
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
            _declare(lib)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _status = f"not built: {exc}"
            log.warning("native decode step unavailable, the torch step runs instead: %s", exc)
            return None
        _library, _status = lib, f"on ({target})"
        return _library


def status() -> str:
    """Whether the native step runs here, and if not why."""
    if not _wanted:
        return "off (native.use(False))"
    library()
    assert _status is not None
    return _status


def reset_for_tests() -> None:
    """Forget the loaded library and its status, so that the next `library()` call decides again."""
    global _library, _status
    with _lock:
        _library, _status = None, None
