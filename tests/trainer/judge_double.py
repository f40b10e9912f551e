"""A stand-in judge server for the host-only judge tests (a test double: the real one is vLLM, which the docker test
in test_judge_twin.py calls). A real HTTP server on 127.0.0.1 in a thread; each test says how it answers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Answer = Callable[[str, dict[str, Any]], tuple[int, Any]]  # (path, request body) -> (status, body: dict or bytes)


def chat_reply(content: str, tokens: int = 10, **choice: Any) -> dict[str, Any]:
    return {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop", **choice}],
            "usage": {"total_tokens": tokens}}


class FakeJudge:
    def __init__(self, answer: Answer, model: str = "judge-double", max_model_len: int = 4096) -> None:
        self.answer, self.requests = answer, []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": model, "max_model_len": max_model_len}]})
                else:
                    self._send(404, {"error": "no route"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with double.lock:
                    double.requests.append((self.path, body, self.headers.get("Authorization")))
                    double.in_flight += 1
                    double.max_in_flight = max(double.max_in_flight, double.in_flight)
                try:
                    status, reply = double.answer(self.path, body)
                finally:
                    with double.lock:
                        double.in_flight -= 1
                self._send(status, reply)

            def _send(self, status: int, reply: Any) -> None:
                data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:  # the client gave up (a timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def posts(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        with self.lock:
            return [body for p, body, _ in self.requests if p == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
