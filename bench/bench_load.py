"""A bounded load run on the read-only endpoints: 50 gradio_client clients for 60 s on localhost.

The server is the real app on a database of 30 real episodes (BFCL ground truth replayed in the
real classes and recorded as episodes). Each client loops over the Traces listing (with a filter),
opening an episode, replaying one of its steps, and the Dashboard's figures. Prints and writes the
error rate and latency percentiles into `bench/results/reliability.json` (key `load`).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from common import RESULTS, machine

from app import envs
from app.store import Recorder, Store
from app.training.rows import expert_episode
from app.ui import build_demo
from app.ui import constants as C

FILTERS = dict(task="", env_class=C.ALL, mode=C.ALL, model=C.ALL, adapter=C.ALL, success=C.ALL, since="", until="")


def seed_database(path: Path, n: int) -> list[str]:
    store = Store(path)
    ids = []
    for task_id in envs.list_tasks("multi_turn_base", "train")[:n]:
        ep = expert_episode(envs.load_task(task_id))
        recorder = Recorder(store)
        recorder.start(ep)
        recorder.pending.extend(ep.steps)
        recorder.flush(ep)
        ids.append(ep.id)
    return ids


def client_loop(url: str, ids: list[str], until: float, out: list, seed: int) -> None:
    from gradio_client import Client

    rng = random.Random(seed)
    try:
        client = Client(url, verbose=False)
    except Exception as exc:
        out.append(("connect", 0.0, repr(exc)))
        return
    while time.monotonic() < until:
        kind = rng.choice(["list_episodes", "open_episode", "replay_step", "dashboard"])
        started = time.monotonic()
        try:
            if kind == "list_episodes":
                client.predict(**{**FILTERS, "task": rng.choice(["", "multi_turn_base_1", "zzz"])},
                               api_name="/list_episodes")
            elif kind == "open_episode":
                client.predict(rng.choice(ids), api_name="/open_episode")
            elif kind == "replay_step":
                client.predict(rng.randint(0, 1), api_name="/replay_step")
            else:
                client.predict(C.ALL, C.ALL, C.ALL, "", "", api_name="/dashboard")
            out.append((kind, time.monotonic() - started, None))
        except Exception as exc:
            out.append((kind, time.monotonic() - started, repr(exc)[:200]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--episodes", type=int, default=30)
    args = parser.parse_args()

    db = Path(tempfile.mkdtemp()) / "load.db"
    ids = seed_database(db, args.episodes)
    demo = build_demo(db_path=str(db))
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    out: list = []
    try:
        until = time.monotonic() + args.seconds
        threads = [threading.Thread(target=client_loop, args=(url, ids, until, out, i)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        demo.close()
    latencies = sorted(s for _, s, err in out if err is None)
    errors = [(k, e) for k, _, e in out if e is not None]
    figures = {"clients": args.clients, "seconds": args.seconds, "requests": len(out), "errors": len(errors),
               "error_rate": round(len(errors) / max(1, len(out)), 4),
               "requests_per_s": round(len(out) / args.seconds, 1),
               "latency_s_p50": round(statistics.median(latencies), 3) if latencies else None,
               "latency_s_p95": round(latencies[int(0.95 * (len(latencies) - 1))], 3) if latencies else None,
               "by_endpoint_p95_s": {k: round(sorted(s for kk, s, e in out if kk == k and e is None)[
                   int(0.95 * (sum(1 for kk, _, e in out if kk == k and e is None) - 1))], 3)
                   for k in {k for k, _, e in out if e is None}},
               "first_errors": errors[:5], "machine": machine()}
    print(json.dumps(figures, indent=1))
    path = RESULTS / "reliability.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["load"] = figures
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
