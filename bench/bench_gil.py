"""Decoding while another Python thread is busy: what the server's switch interval buys.

The web server runs a step in a worker thread, next to Gradio's event loop and other visitors' callbacks.
The decode loop gives the GIL up and takes it back at every tensor op (about 500 a token). While another
thread runs pure Python, each take waits for that thread's switch interval (5 ms by default), so a token
can cost seconds. This bench decodes batch 1 (fp16 weights, ~1,000 tokens of context) alone, then beside a
busy pure-Python thread at several switch intervals, and counts the busy thread's own work at each (what
a shorter interval costs it). `app.ui.SWITCH_INTERVAL_S` is what the server sets.

Writes bench/results/gil.json. Run: `.venv/bin/python bench/bench_gil.py [--tokens 20] [--repeats 3]`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch
from common import write_results

from app.ui import SWITCH_INTERVAL_S
from bench_decode import realistic_prompt_messages
from model_backend import Prompt, load_policy
from model_backend.decoding import prefill
from model_backend.fast_step import decode_step

INTERVALS = (0.005, 0.001, 0.0005, SWITCH_INTERVAL_S, 0.0001)


class Busy:
    """A thread running pure Python (as a callback rendering a page, or parsing an upload, would)."""

    def __init__(self) -> None:
        self.running = True
        self.count = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while self.running:
            sum(range(200))
            self.count += 1


def decode_rate(policy, ids: list[int], tokens: int) -> float:
    """Batch-1 tokens/s of the lean step after a prefill (the product's decode path)."""
    with torch.inference_mode():
        pre = prefill(policy.model, [ids], [1], keep=1, pad_id=policy.pad_id)
        step = decode_step(policy.model, pre.cache)
        positions, token = pre.next_positions, torch.tensor([[5]])
        for _ in range(3):
            step(token, None, positions[:, None])
            positions = positions + 1
        started = time.perf_counter()
        for _ in range(tokens):
            step(token, None, positions[:, None])
            positions = positions + 1
        return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=20, help="tokens decoded per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per switch interval")
    args = parser.parse_args()
    policy = load_policy("embedded", weights="fp16")
    ids = policy.encode(Prompt(realistic_prompt_messages(1000, policy.count_tokens)))[:1000]
    default = sys.getswitchinterval()

    busy = Busy()
    busy.thread.start()
    time.sleep(1.0)
    busy_alone = busy.count  # iterations in one second with the cores to itself (the model idle)
    busy.running = False
    busy.thread.join()
    alone = decode_rate(policy, ids, args.tokens)
    print(f"alone: decode {alone:.1f} tok/s; busy thread {busy_alone} iterations/s")

    rows = []
    for interval in INTERVALS:
        sys.setswitchinterval(interval)
        rates, busy_rates = [], []
        for _ in range(args.repeats):  # runs differ a lot at the longer intervals (which core each thread gets)
            busy = Busy()
            busy.thread.start()
            tokens = max(3, args.tokens // 4) if interval >= 0.005 else args.tokens  # can be 0.1 tok/s: keep it short
            started, before = time.perf_counter(), busy.count
            rates.append(decode_rate(policy, ids, tokens))
            busy_rates.append((busy.count - before) / (time.perf_counter() - started))
            busy.running = False
            busy.thread.join()
        rate, busy_rate = statistics.median(rates), statistics.median(busy_rates)
        rows.append({"switch_interval_s": interval, "decode_tok_s": [round(r, 2) for r in rates],
                     "decode_share_of_alone_median": round(rate / alone, 3),
                     "busy_iterations_per_s": [round(r) for r in busy_rates],
                     "busy_share_of_alone_median": round(busy_rate / busy_alone, 3),
                     "server_setting": interval == SWITCH_INTERVAL_S})
        print(f"busy thread, switch interval {interval * 1e3:g} ms: decode {', '.join(f'{r:.2f}' for r in rates)} "
              f"tok/s (median {rate / alone:.0%} of alone); busy thread median {busy_rate / busy_alone:.0%} of alone")
    sys.setswitchinterval(default)
    write_results("gil", {"context_tokens": len(ids), "weights": "fp16", "decode_alone_tok_s": round(alone, 2),
                          "busy_alone_iterations_per_s": busy_alone, "python_default_interval_s": default,
                          "server_interval_s": SWITCH_INTERVAL_S, "with_busy_thread": rows})


if __name__ == "__main__":
    main()
