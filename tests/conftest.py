import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test-fast` runs two workers (pytest-xdist) on two cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one math thread each, or torch's threads fight over the cores


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Which CPU ran the suite and which of its instruction-set paths the tests took (the suite must pass on
    AVX2-only and on AVX-512/AMX x86 machines alike; a failure is read against this line). At the end, so
    that `-q` runs (`make test`) print it too."""
    from cpu_info import cpu_summary

    terminalreporter.write_sep("-", "machine")
    terminalreporter.write_line(cpu_summary())


def pytest_addoption(parser) -> None:
    parser.addoption("--engines", action="store_true",
                     help="run the tests marked `engines` (a real serving engine from .venv-bench: make check-engines)")


def pytest_collection_modifyitems(config, items) -> None:
    """`engines` tests need the benchmark environment (`make check-engines` builds it): deselected without
    `--engines`, so `make test` and `make test-fast` never start them (deselected, not skipped: they are not run)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        heavy_modules_first(items)
    if config.getoption("--engines"):
        return
    keep = [item for item in items if item.get_closest_marker("engines") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("engines")])
        items[:] = keep


HEAVY = ("slow", "browser", "mcp")


def heavy_modules_first(items: list) -> None:
    """Under pytest-xdist (`make test`: `--dist loadfile --no-loadscope-reorder`), the modules with a `slow`,
    `browser` or `mcp` test go first, each module's tests kept together and in order. The workers take modules in
    this order as they come free, so the long ones (the Spaces venv, eight browsers, real fine-tunes) start early
    and the short ones fill the end. xdist's own order (the modules with the most tests first) left the one-test
    Spaces module and the `test_ui_*` files for the end, on one worker while the other sat idle."""
    module = {id(it): it.nodeid.split("::", 1)[0] for it in items}
    heavy = {module[id(it)] for it in items if any(it.get_closest_marker(m) is not None for m in HEAVY)}
    rank = {m: i for i, m in enumerate(dict.fromkeys(module.values()))}
    items.sort(key=lambda it: (module[id(it)] not in heavy, rank[module[id(it)]]))


# ---------------------------------------------------------------- shared fixtures


@pytest.fixture(scope="module")
def base_policy():
    """The embedded model without an adapter (loaded once per test module)."""
    from model_backend import load_policy

    return load_policy("embedded")


@pytest.fixture(scope="module")
def shipped_policy():
    """The embedded model with the shipped LoRA adapter, as the app loads it by default (once per module)."""
    from app.config import shipped_adapter
    from model_backend import load_policy

    return load_policy("embedded", adapter=shipped_adapter())
