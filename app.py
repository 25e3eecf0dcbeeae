"""Hugging Face Spaces entry: build the inspector and serve it.

A Gradio Space installs `requirements.txt` with dependencies and nothing else, so the
packages of `requirements-nodeps.txt` (the embedded model's GGUF, the BFCL environments)
are installed here with `--no-deps` when the app runs on a Space (Spaces set SPACE_ID)
and they are missing. Locally, `make setup` installs them; this file then only launches.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent
NODEPS = ROOT / "requirements-nodeps.txt"

log = logging.getLogger("app")


def pinned(path: Path = NODEPS) -> list[tuple[str, str]]:
    """(name, version) of each `name==version` line of a requirements file."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out.append((name.strip(), version.strip()))
    return out


def missing(requirements: list[tuple[str, str]]) -> list[str]:
    """The `name==version` pins not installed at that version."""
    out = []
    for name, version in requirements:
        try:
            if metadata.version(name) == version:
                continue
        except metadata.PackageNotFoundError:
            pass
        out.append(f"{name}=={version}")
    return out


def install_nodeps() -> None:
    """On a Space, install the `--no-deps` packages that are missing (a no-op once they are there)."""
    if not os.environ.get("SPACE_ID"):
        return
    todo = missing(pinned())
    if todo:
        log.warning("installing without dependencies: %s", " ".join(todo))
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", *todo])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    install_nodeps()
    from app.ui import build_demo, close_demo
    from app.ui import constants as C

    # Spaces set GRADIO_SERVER_NAME/PORT; the database defaults to /data (persistent storage) when present.
    from app.cli.main import shutdown_event, wait_for

    demo = build_demo()
    stop = shutdown_event()  # SIGTERM (a Space stopping) and Ctrl+C shut the server down cleanly
    demo.launch(max_file_size=f"{C.MAX_IMPORT_MB}mb", prevent_thread_lock=True)
    wait_for(stop)
    close_demo(demo)


if __name__ == "__main__":
    main()
