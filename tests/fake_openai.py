"""A test double of an OpenAI-compatible server: stdlib `http.server` on localhost, answers scripted.

It stands in for a real server only where the tests need one to misbehave on purpose
(malformed JSON, no choices, a 429 storm, a cut-off answer, a server that dies mid-episode)
or to answer a scripted model quickly. The real server in the tests is `transformers serve`.
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from helpers import free_port  # noqa: F401 (re-exported: test_remote.py imports it from here)

Reply = tuple[int, Any]
"""(HTTP status, body): a dict/list is sent as JSON, bytes/str as they are."""
Handler = Callable[[str, str, dict[str, Any]], Reply]


def chat_reply(text: str, finish: str = "stop", n: int = 1, **extra: Any) -> dict[str, Any]:
    return {"object": "chat.completion", "model": "fake",
            "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         **extra} for i in range(n)],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5}}


def models_reply(*ids: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}


class FakeOpenAIServer:
    """Serves `handler(method, path, body)` on 127.0.0.1; records every request (method, path, body)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        outer = self

        class _Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet tests
                pass

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else {}
                body["_headers"] = dict(self.headers)
                with outer._lock:
                    outer.requests.append((method, self.path, body))
                status, payload = outer.handler(method, self.path, body)
                data = payload if isinstance(payload, bytes) else (
                    payload.encode() if isinstance(payload, str) else json.dumps(payload).encode())
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def posts(self, path: str | None = None) -> list[dict[str, Any]]:
        return [b for m, p, b in self.requests if m == "POST" and (path is None or p.endswith(path))]

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


def serving(model: str, post: Callable[[str, dict[str, Any]], Reply]) -> Handler:
    """A handler whose /v1/models lists `model` and whose POSTs go to `post(path, body)`."""

    def handler(method: str, path: str, body: dict[str, Any]) -> Reply:
        if method == "GET" and path.endswith("/models"):
            return 200, models_reply(model)
        return post(path, body)

    return handler


def kv_agent(path: str, body: dict[str, Any]) -> Reply:
    """A scripted model for the mock key-value task, in chat mode (vLLM-like: continues a prefill).

    Act: the next gold call of the turn from how many tool results follow the last user message,
    then a plain answer. Rehearse: `{"ok": true}`.
    """
    messages = body.get("messages") or []
    system = messages[0]["content"] if messages else ""
    if system.startswith("You simulate tools"):
        return 200, chat_reply('{"ok": true}</execution_result>')
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    results = sum(1 for m in messages[last_user:] if m["role"] == "tool")
    request = messages[last_user]["content"]
    if "blue" in request:
        plan = ['{"name": "set", "arguments": {"key": "color", "value": "blue"}}']
    else:
        plan = ['{"name": "delete", "arguments": {"key": "size"}}', '{"name": "get", "arguments": {"key": "color"}}']
    if results < len(plan):
        return 200, chat_reply(f"<tool_call>{plan[results]}</tool_call>")
    return 200, chat_reply("Done: the colour is blue.")
