"""A stdio MCP server that misbehaves on request, for the client's failure tests.

Written against the wire format (newline-delimited JSON-RPC 2.0, the 2025-11-25 handshake)
without the SDK, so it can send what no SDK server would: a malformed result, structured
content that breaks its own output schema, a crash mid-call, an answer that never comes.
Tools: `echo` (read-only), `sleep`, `crash`, `malformed`, `bad_structured`, `counter_add`
(keeps a count in `<state>/count.txt` when started with a state folder as its argument).
"""
import json
import os
import sys
import threading
import time
from pathlib import Path

STATE = Path(sys.argv[1]) if len(sys.argv) > 1 else None
OBJ = {"type": "object"}
TOOLS = [
    {"name": "echo", "description": "Echo the text.", "annotations": {"readOnlyHint": True},
     "inputSchema": {**OBJ, "properties": {"text": {"type": "string"}}, "required": ["text"]}},
    {"name": "sleep", "description": "Answer after some seconds.",
     "inputSchema": {**OBJ, "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}},
    {"name": "crash", "description": "Exit without answering.", "inputSchema": {**OBJ, "properties": {}}},
    {"name": "malformed", "description": "Answer with a result that is not a CallToolResult.",
     "inputSchema": {**OBJ, "properties": {}}},
    {"name": "bad_structured", "description": "Structured content that breaks the output schema.",
     "inputSchema": {**OBJ, "properties": {}},
     "outputSchema": {**OBJ, "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
    {"name": "counter_add", "description": "Add to the counter in the state folder.",
     "annotations": {"readOnlyHint": False, "destructiveHint": False},
     "inputSchema": {**OBJ, "properties": {"by": {"type": "integer"}}, "required": ["by"]},
     "outputSchema": {**OBJ, "properties": {"count": {"type": "integer"}}, "required": ["count"]}},
]


LOCK = threading.Lock()


def send(message):
    with LOCK:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def text(value):
    return {"content": [{"type": "text", "text": value}], "isError": False}


def call(name, args):
    if name == "echo":
        return text(args["text"])
    if name == "sleep":
        time.sleep(args["seconds"])
        return text("slept")
    if name == "crash":
        sys.stderr.write("faulty server: crashing on purpose\n")
        sys.stderr.flush()
        os._exit(3)
    if name == "malformed":
        return {"content": "this should be a list of content blocks", "isError": "maybe"}
    if name == "bad_structured":
        return {"content": [{"type": "text", "text": "{\"n\": \"seven\"}"}], "structuredContent": {"n": "seven"}}
    if name == "counter_add":
        path = STATE / "count.txt"
        count = int(path.read_text()) if path.exists() else 0
        path.write_text(str(count + args["by"]))
        return {"content": [{"type": "text", "text": str(count + args["by"])}],
                "structuredContent": {"count": count + args["by"]}}
    return {"content": [{"type": "text", "text": f"unknown tool {name}"}], "isError": True}


for line in sys.stdin:
    request = json.loads(line)
    method, rid = request.get("method"), request.get("id")
    if rid is None:
        continue  # notifications
    if method == "initialize":
        result = {"protocolVersion": request["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "faulty", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": TOOLS}
    elif method == "tools/call":  # each call in its own thread: a slow one does not hold up the rest
        params = request["params"]
        threading.Thread(target=lambda rid=rid, params=params: send(
            {"jsonrpc": "2.0", "id": rid, "result": call(params["name"], params.get("arguments") or {})}),
            daemon=True).start()
        continue
    else:
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"method not found: {method}"}})
        continue
    send({"jsonrpc": "2.0", "id": rid, "result": result})
