"""Helpers shared by the benchmark scripts: where results go, and machine facts."""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))


def cpu() -> str:
    """The CPU's model name and its widest vector units (figures differ a lot between such machines)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    units = [u for u in ("amx_tile", "avx512_bf16", "avx512f", "avx2") if u in flags]
    return f"{name} ({', '.join(units) or 'no AVX2'})"


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "cpu": cpu(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "load_average": os.getloadavg()}


def write_results(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"machine": machine(), **data}
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return path


def paired_ratio(k1: list[dict], k4: list[dict], field: str = "seconds") -> float:
    """Median over (task, step) pairs of K=4's `field` over K=1's. Unlike a ratio of two p50s, it does not
    hang on where one median falls (a third of the steps are a task's first, several times the others)."""
    one = {(r["task"], r["step"]): r[field] for r in k1}
    return round(statistics.median(r[field] / one[(r["task"], r["step"])] for r in k4
                                   if (r["task"], r["step"]) in one), 2)
