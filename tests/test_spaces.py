"""The Spaces path: a fresh virtual environment with only requirements.txt installed (as a
Gradio Space does), then `app.py` installs the --no-deps packages itself, starts, and serves
a working Run tab (one real Step with the embedded model through gradio_client)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from gradio_client import Client

from app.ui import constants as C
from helpers import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_fresh_venv_with_requirements_txt_serves_the_run_tab(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # --no-compile: what is tested is that requirements.txt is complete; byte-compiling every installed file
    # (torch's thousands) took 49 of the install's 76 s here and tests nothing.
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-compile", "-r", str(ROOT / "requirements.txt")],
                             capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-2000:]
    missing = subprocess.run([str(py), "-c", "import importlib.util as u; print(u.find_spec('bfcl_eval'))"],
                             capture_output=True, text=True)
    assert missing.stdout.strip() == "None"  # only requirements.txt: the --no-deps packages are absent

    port = free_port()
    env = {**os.environ, "SPACE_ID": "test/envace-inspector", "GRADIO_SERVER_NAME": "127.0.0.1",
           "GRADIO_SERVER_PORT": str(port), "ENVACE_DB": str(tmp_path / "space.db"), "PYTHONPATH": ""}
    log = open(tmp_path / "app.log", "w")
    proc = subprocess.Popen([str(py), str(ROOT / "app.py")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/"

        def connect() -> Client | None:
            assert proc.poll() is None, (tmp_path / "app.log").read_text()[-3000:]
            try:
                return Client(url, verbose=False)
            except Exception:  # not up yet
                return None

        client = wait_until(connect, 600, interval=1, message="app.py did not start serving")
        assert "installing without dependencies" in (tmp_path / "app.log").read_text()
        d = C.UI_DEFAULTS
        message, status, chat, timeline, cards, state = client.predict(
            source=C.SOURCE_TASK, task=C.DEFAULT_TASK, instruction="", instruction_env="GorillaFileSystem",
            model=C.DEFAULT_MODEL, adapter=C.NO_ADAPTER, mode="parallel", branches=2, selector="logprob",
            temperature=d["temperature"], seed=0, shadow=True, rehearsal_context="history", tool_choice="required",
            max_action_tokens=32, max_rehearsal_tokens=32, api_name="/step")
        assert "ea-msg-error" not in message, message
        assert cards.count("data-branch=") >= 1 and "Predicted" in cards and "ea-committed" in cards
        assert "in progress" in status  # one step of a task's first turn: the episode goes on
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
