"""How long importing a 1,000-call trace file takes (issue 37's goal: under 10 s), for both foreign formats.

Generates, in a temporary folder, a chat JSONL file and an OTLP/JSON file of 1,000 recorded tool calls each (100
transcripts/traces of 10 calls with their results and a final answer), then times `read_foreign` (read, check,
build the episodes) and `import_records` (one transaction into a fresh SQLite file) separately. Prints the figures
and writes bench/results/import.json.

usage: python bench/bench_import.py [--calls 1000] [--per-trace 10]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import write_results

from app.store import Store
from app.trace_io import import_records, read_foreign


def chat_file(path: Path, traces: int, per: int) -> None:
    tools = [{"type": "function", "function": {"name": "get_item", "description": "Read an item.", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}}}]
    with path.open("w") as f:
        for t in range(traces):
            messages = [{"role": "system", "content": "You look items up."},
                        {"role": "user", "content": f"Look up items {t * per} to {t * per + per - 1}."}]
            for i in range(per):
                cid = f"call_{t}_{i}"
                messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function",
                                 "function": {"name": "get_item", "arguments": json.dumps({"id": t * per + i})}}]})
                messages.append({"role": "tool", "tool_call_id": cid,
                                 "content": json.dumps({"id": t * per + i, "name": f"item {i}", "stock": i * 3})})
            messages.append({"role": "assistant", "content": "All found."})
            f.write(json.dumps({"messages": messages, "tools": tools}) + "\n")


def otlp_file(path: Path, traces: int, per: int) -> None:
    def attrs(d):
        return [{"key": k, "value": {"stringValue": v if isinstance(v, str) else json.dumps(v)}} for k, v in d.items()]
    t0 = 1_796_000_000_000_000_000
    with path.open("w") as f:
        for t in range(traces):
            trace = f"{t + 1:032x}"
            spans = [{"traceId": trace, "spanId": f"{t + 1:08x}{0:08x}", "name": "chat", "kind": 1,
                      "startTimeUnixNano": str(t0), "endTimeUnixNano": str(t0 + 1), "attributes": attrs({
                          "gen_ai.operation.name": "chat", "gen_ai.request.model": "bench-model",
                          "gen_ai.input.messages": [{"role": "user", "parts": [{"type": "text", "content": f"items {t}"}]}],
                          "gen_ai.tool.definitions": [{"type": "function", "name": "get_item", "parameters": {
                              "type": "object", "properties": {"id": {"type": "integer"}}}}]})}]
            for i in range(per):
                start = t0 + (i + 1) * 1000
                spans.append({"traceId": trace, "spanId": f"{t + 1:08x}{i + 1:08x}", "name": "execute_tool get_item",
                              "kind": 1, "startTimeUnixNano": str(start), "endTimeUnixNano": str(start + 500),
                              "attributes": attrs({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_item",
                                                   "gen_ai.tool.call.arguments": {"id": t * per + i},
                                                   "gen_ai.tool.call.result": {"id": t * per + i, "stock": i * 3}})})
            f.write(json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": spans}]}]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--per-trace", type=int, default=10)
    args = ap.parse_args()
    traces = args.calls // args.per_trace
    out: dict = {"calls": traces * args.per_trace, "traces": traces, "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, make in (("openai", chat_file), ("otlp", otlp_file)):
            path = Path(tmp) / f"{fmt}.jsonl"
            make(path, traces, args.per_trace)
            start = time.perf_counter()
            records = read_foreign(path, fmt)
            parsed = time.perf_counter() - start
            store = Store(Path(tmp) / f"{fmt}.db")
            start = time.perf_counter()
            result = import_records(store, records)
            written = time.perf_counter() - start
            calls = sum(1 for r in records for s in r.episode.steps if s.kind == "call")
            out["formats"][fmt] = {"file_bytes": path.stat().st_size, "episodes": len(result.imported), "calls": calls,
                                   "read_check_s": round(parsed, 3), "write_s": round(written, 3),
                                   "total_s": round(parsed + written, 3)}
            print(f"{fmt}: {calls} calls in {len(result.imported)} episodes ({path.stat().st_size / 2**20:.2f} MiB): "
                  f"read and checked in {parsed:.2f} s, written in {written:.2f} s, {parsed + written:.2f} s in all")
    write_results("import", out)


if __name__ == "__main__":
    main()
