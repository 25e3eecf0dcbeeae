"""kill -9 in the middle of work, with real processes and the real embedded model.

The server (`python -m app serve`) is killed while a step runs: after a restart the database
passes `PRAGMA integrity_check`, the episode keeps only its complete steps and is marked
interrupted. A fine-tune (`python -m app finetune`) is killed while it trains: no adapter is
registered and its output directory does not exist.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import re
from pathlib import Path

import pytest

from app.service import Services
from app.records import Annotation
from app.store import Store
from helpers import form, free_port, wait_until
from scripted import mock_episode


ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def start(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "app", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **env}, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (no handler runs, nothing is flushed), and reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def wait_for(check, timeout: float, proc: subprocess.Popen, log: Path):
    """`check()`'s first truthy value; fails at once if the process exits, or after `timeout` seconds."""
    def alive_check():
        if proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}): {log.read_text()[-2000:]}")
        return check()
    return wait_until(alive_check, timeout, interval=0.2, message=lambda: log.read_text()[-2000:])


def integrity(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        return conn.execute("pragma integrity_check").fetchone()[0]


def test_a_server_killed_mid_step_leaves_a_sound_database_and_an_interrupted_episode(tmp_path: Path) -> None:
    from gradio_client import Client

    db, log, port = tmp_path / "kill.db", tmp_path / "serve.log", free_port()
    # No step computed ahead: the second step's model calls run inside the request that the kill interrupts.
    proc = start(["serve", "--db", str(db), "--port", str(port), "--host", "127.0.0.1"], log,
                 ENVACE_COMPUTE_AHEAD="0")
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for(lambda: _answers(url), 180, proc, log)
        client = Client(url, verbose=False)
        values = form(task="bfcl:multi_turn_base_0", max_action_tokens=48, max_rehearsal_tokens=48, branches=4,
                      selector="logprob")
        client.predict(**values, api_name="/step")  # one complete step (the model loads first)
        store = Store(db)
        [row] = store.list_episodes()
        assert row["n_steps"] == 1 and row["status"] == "running"
        second = client.submit(**values, api_name="/step")
        # In flight: the callback has sent its "Working…" view, which it yields just before the step's model
        # calls (a K=4 step takes seconds); the assertions below (one stored step) prove it had not finished.
        wait_for(lambda: any("Working" in str(out[0]) for out in second.outputs()), 120, proc, log)
    finally:
        kill(proc)
    assert integrity(db) == "ok"
    services = Services(str(db))  # the next start
    ep = services.store.get_episode(row["id"])
    assert ep.status == "interrupted" and len(ep.steps) == 1  # the half-made step is nowhere
    assert [s.index for s in ep.steps] == [0] and ep.steps[0].chosen_branch.chosen


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_a_fine_tune_killed_mid_training_registers_nothing(tmp_path: Path) -> None:
    db, log, out = tmp_path / "ft.db", tmp_path / "ft.log", tmp_path / "adapters" / "killed"
    store = Store(db)
    _, _, ep = mock_episode(store=store)
    branch_ids = [r["id"] for r in store.branch_rows(ep.id) if r["kind"] == "call"]
    for branch_id in branch_ids[:3]:
        store.add_annotation(Annotation(branch_id=branch_id, label="major", corrected_predicted={"ok": False}))
    # An earlier fine-tune made the default: a killed one must leave it so.
    store.db["adapters"].insert({"id": "parent", "path": str(tmp_path / "parent"), "parent": None,
                                 "base_model": "embedded", "data": "{}", "metrics": "{}", "created_at": "then",
                                 "is_default": 1, "default_reason": "made the default"})
    proc = start(["finetune", "--db", str(db), "--steps", "10000", "--out", str(out), "--parent", "none",
                  "--no-agreement"], log)
    try:
        # Killed once two optimizer steps are done (tqdm's "n/10000" on stderr): mid-training, far from the end.
        wait_for(lambda: max(map(int, re.findall(r"(\d+)/10000", log.read_text())), default=0) >= 2, 240, proc, log)
    finally:
        kill(proc)
    assert integrity(db) == "ok"
    assert [r["id"] for r in store.db["adapters"].rows] == ["parent"]
    assert store.default_adapter() == str(tmp_path / "parent")
    assert not out.exists()
    leftovers = [p for p in out.parent.iterdir()] if out.parent.exists() else []
    assert all(not (p / "adapter_config.json").exists() for p in leftovers)
