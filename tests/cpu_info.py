"""What the machine running the tests is: the CPU's model name, the instruction-set features that change
which kernels run (torch's own dispatch level, AVX-512, VNNI, AMX), and whether the native decode step
(`model_backend/native_decode.c`, AVX2/FMA/F16C) runs here. Printed in pytest's header."""
from __future__ import annotations

from pathlib import Path

FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def _cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown", set()
    name, flags = "unknown", set()
    for line in text.splitlines():
        if line.startswith("model name") and name == "unknown":
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    return name, flags


def cpu_summary() -> str:
    import torch

    from model_backend import native

    name, flags = _cpuinfo()
    present = ", ".join(f for f in FEATURES if f in flags) or "none of " + "/".join(FEATURES)
    return (f"cpu: {name}; features: {present}; torch cpu capability: {torch.backends.cpu.get_cpu_capability()}; "
            f"native decode step: {native.status()}")
