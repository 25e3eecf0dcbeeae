"""Step latency at K=1 and K=4: the embedded model through `transformers serve` vs the local backend.

A step is the whole decision (Act K candidates, Rehearse every call, selection, shadow
execution, commit, metrics), parallel mode, selector `logprob` on both sides (`transformers
serve` returns no prompt log-probabilities, so `judge` cannot run on it), `tool_choice=required`
so every branch is rehearsed. Both sides run the bare base weights (the server cannot apply our
LoRA adapter).

Where the time goes, per remote step:
- `http_s`: wall time with at least one request in flight (requests of a step overlap);
- `network_s`: requests x the median round trip of a tiny `GET /v1/models` (connection, HTTP
  framing, JSON; an upper bound of the transport's share);
- `server_s`: `http_s - network_s` (queueing plus generation on the server);
- `client_s`: step wall time minus `http_s` (prompt rendering, tokenization, parsing,
  environment calls, the store is not involved here).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import ROOT, write_results

sys.path.insert(0, str(ROOT / "tests"))

from app import envs  # noqa: E402
from app.engine import EpisodeRunner  # noqa: E402
from app.records import RunSettings  # noqa: E402


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="bfcl:multi_turn_base_0")
    parser.add_argument("--steps", type=int, default=2, help="steps timed per (backend, K)")
    parser.add_argument("--ks", default="1,4")
    parser.add_argument("--max-action-tokens", type=int, default=48)
    parser.add_argument("--max-rehearsal-tokens", type=int, default=48)
    args = parser.parse_args()

    import httpx
    import served

    import model_backend

    task = envs.load_task(args.task)
    ks = [int(k) for k in args.ks.split(",")]
    ckpt = served.embedded_checkpoint()
    local = model_backend.load_policy("embedded")
    t0 = time.perf_counter()
    proc, url, _ = served.start(ckpt)
    startup_s = time.perf_counter() - t0
    try:
        remote = model_backend.load_policy(f"openai:{url}#{ckpt}?timeout=600")
        rtts = []
        for _ in range(20):
            t = time.perf_counter()
            httpx.get(f"{url}/models", timeout=10)
            rtts.append(time.perf_counter() - t)
        rtt = statistics.median(rtts)

        def run(policy, k: int) -> list[dict]:
            settings = RunSettings(mode="parallel", branches=k, selector="logprob", seed=0, tool_choice="required",
                                   max_action_tokens=args.max_action_tokens,
                                   max_rehearsal_tokens=args.max_rehearsal_tokens)
            runner = EpisodeRunner(task, policy, settings)
            out = []
            for _ in range(args.steps):
                stats = getattr(policy, "stats", None)
                mark = len(stats) if stats is not None else 0
                started = time.perf_counter()
                step = runner.step()
                wall = time.perf_counter() - started
                if step is None:
                    break
                row = {"wall_s": round(wall, 3), "branches": len(step.branches), "rehearsals": step.rehearsals}
                if stats is not None:
                    mine = stats[mark:]
                    http = busy_time([(s.started, s.started + s.seconds) for s in mine])
                    network = min(http, rtt * len(mine))
                    row.update(requests=len(mine), http_s=round(http, 3), network_s=round(network, 3),
                               server_s=round(http - network, 3), client_s=round(wall - http, 3),
                               completion_tokens=sum(s.completion_tokens or 0 for s in mine))
                out.append(row)
            return out

        run(local, 1)  # warm-up of both sides (first-call allocations, the server's first request)
        run(remote, 1)
        results: dict[str, dict] = {}
        for name, policy in (("local", local), ("transformers_serve", remote)):
            for k in ks:
                rows = run(policy, k)
                summary = {"mean_s": round(statistics.mean(r["wall_s"] for r in rows), 3), "steps": rows}
                for key in ("http_s", "network_s", "server_s", "client_s"):
                    if rows and key in rows[0]:
                        summary[f"mean_{key}"] = round(statistics.mean(r[key] for r in rows), 3)
                results[f"{name}_k{k}"] = summary
                print(f"{name} K={k}: {summary['mean_s']:.2f} s/step "
                      + " ".join(f"{x}={summary[f'mean_{x}']:.2f}" for x in ("server_s", "network_s", "client_s")
                                 if f"mean_{x}" in summary))
    finally:
        served.stop(proc)
    write_results("remote", {
        "task": args.task, "mode": "parallel", "selector": "logprob", "tool_choice": "required",
        "max_action_tokens": args.max_action_tokens, "max_rehearsal_tokens": args.max_rehearsal_tokens,
        "server": "transformers serve (no continuous batching: one request at a time), CPU, fp32",
        "server_startup_s": round(startup_s, 2), "median_rtt_s": round(rtt, 5), "results": results,
    })


if __name__ == "__main__":
    main()
