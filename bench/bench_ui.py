"""UI overhead per step, model excluded (goal: at most 150 ms).

A scripted policy stands in for the model (it answers in microseconds), so what is timed
is everything the inspector adds around a step: the engine's bookkeeping, shadow
execution on forks, the SQLite write, and rendering (conversation, branch cards with
diffs, state diff, timeline). Three views:
- `callback`: the Step callback in-process (RunCallbacks.step, all of its yields);
- `render`: the final view alone (what every streamed update costs);
- `end_to_end`: the Step event through the Gradio server with gradio_client (adds
  queueing, serialization, HTTP and the Chatbot's postprocessing);
- `trivial_event`: a near-empty event through the same path: the framework's floor.
Tasks: the default task and a long-context task (large environment state). The goal is
read on `callback` (the inspector's own work); `end_to_end` minus `trivial_event` shows
what the Step event costs in Gradio on top of a bare round trip.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, write_results

sys.path.insert(0, str(ROOT / "tests"))

from scripted import ScriptedPolicy  # noqa: E402

from app.service import RunSession, Services  # noqa: E402
from app.ui import constants as C  # noqa: E402
from app.ui.run_callbacks import RunCallbacks  # noqa: E402

CALLS = ['<tool_call>{"name": "ls", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "pwd", "arguments": {}}</tool_call>',
         '<tool_call>{"name": "mkdir", "arguments": {"dir_name": "bench"}}</tool_call>',
         '<tool_call>{"name": "cat", "arguments": {"file_name": "notes.txt"}}</tool_call>']
TASKS = ("bfcl:multi_turn_base_0", "bfcl:multi_turn_long_context_0")


def loader(model: str, adapter: str | None) -> ScriptedPolicy:
    return ScriptedPolicy([CALLS] * 10_000, predict=lambda prompt: {"current_directory_content": ["document"]})


def form(task: str, k: int) -> dict:
    d = C.UI_DEFAULTS
    return dict(source=C.SOURCE_TASK, task=task, instruction="", instruction_env="GorillaFileSystem",
                model=C.DEFAULT_MODEL, adapter=C.NO_ADAPTER, mode="parallel", branches=k, selector="judge",
                temperature=0.8, seed=0, shadow=True, rehearsal_context="history", tool_required=True,
                max_action_tokens=d["max_action_tokens"], max_rehearsal_tokens=d["max_rehearsal_tokens"])


def summary(times: list[float]) -> dict:
    ms = sorted(t * 1000 for t in times)
    return {"n": len(ms), "mean_ms": round(statistics.mean(ms), 1), "p50_ms": round(ms[len(ms) // 2], 1),
            "p95_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.95))], 1), "max_ms": round(ms[-1], 1)}


def in_process(services: Services, task: str, k: int, steps: int) -> tuple[dict, dict]:
    cb = RunCallbacks(services)
    session = RunSession()
    quiet = lambda *a, **kw: None  # noqa: E731  (no Gradio progress bar outside a request)
    for _ in cb.step(session, progress=quiet, **form(task, k)):  # warm-up: loads the task, opens the episode
        pass
    callback, render = [], []
    for _ in range(steps):
        if session.runner.done:
            session.reset(services)
        t0 = time.perf_counter()
        for _ in cb.step(session, progress=quiet, **form(task, k)):
            pass
        callback.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cb.view(session)
        render.append(time.perf_counter() - t0)
    return summary(callback), summary(render)


def end_to_end(db: str, task: str, k: int, steps: int) -> tuple[dict, dict]:
    from gradio_client import Client

    from app.ui import build_demo

    demo = build_demo(db_path=db, policy_loader=loader)
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)  # first free port
    try:
        client = Client(url, verbose=False)
        client.predict(**form(task, k), api_name="/step")
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = client.predict(**form(task, k), api_name="/step")
            times.append(time.perf_counter() - t0)
            if "This episode is over" in out[0]:
                client.predict(**form(task, k), api_name="/reset")
        floor = []
        for _ in range(steps):
            t0 = time.perf_counter()
            client.predict(api_name="/annotate_next")  # empty queue: a trivial event, the framework's round trip
            floor.append(time.perf_counter() - t0)
        return summary(times), summary(floor)
    finally:
        demo.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per task")
    parser.add_argument("--k", type=int, default=4, help="branches per step")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        services = Services(str(Path(tmp) / "bench.db"), loader)
        for task in TASKS:
            callback, render = in_process(services, task, args.k, args.steps)
            e2e, floor = end_to_end(str(Path(tmp) / f"e2e-{task.replace(':', '_')}.db"), task, args.k, args.steps)
            results[task] = {"callback": callback, "render": render, "end_to_end": e2e, "trivial_event": floor}
            print(f"{task}: callback p50 {callback['p50_ms']} ms (p95 {callback['p95_ms']}), render p50 "
                  f"{render['p50_ms']} ms, end-to-end p50 {e2e['p50_ms']} ms (p95 {e2e['p95_ms']}); "
                  f"a trivial event round trip p50 {floor['p50_ms']} ms")
    worst = max(r["callback"]["p50_ms"] for r in results.values())
    worst_e2e = max(r["end_to_end"]["p50_ms"] for r in results.values())
    print(f"UI overhead per step (Step callback, worst task) p50: {worst} ms (goal <= 150 ms); "
          f"through Gradio and gradio_client p50: {worst_e2e} ms")
    write_results("ui", {"what": "UI overhead per step, model excluded (scripted policy)", "k": args.k,
                         "steps": args.steps, "goal_ms": 150, "worst_callback_p50_ms": worst,
                         "worst_end_to_end_p50_ms": worst_e2e, "results": results})

if __name__ == "__main__":
    main()
