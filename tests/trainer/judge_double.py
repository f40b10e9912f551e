"""A stand-in judge server for the judge tests (a test double: the real one is vLLM, which the docker test in
test_judge_twin.py calls). A real HTTP server on 127.0.0.1 in a thread; each test says how it answers. Standard library
only: `python3 judge_double.py --port N` serves one in a container (tests/envs/test_generic_containers.py), answering
9 and failing every other call."""

from __future__ import annotations

import argparse
import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

Answer = Callable[[str, dict[str, Any]], tuple[int, Any]]  # (path, request body) -> (status, body: dict or bytes)


def chat_reply(content: str, tokens: int = 10, **choice: Any) -> dict[str, Any]:
    return {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": "stop", **choice}],
            "usage": {"total_tokens": tokens}}


class FakeJudge:
    def __init__(self, answer: Answer, model: str = "judge-double", max_model_len: int = 4096,
                 host: str = "127.0.0.1", port: int = 0) -> None:
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

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def posts(self, path: str = "/v1/chat/completions") -> list[dict[str, Any]]:
        with self.lock:
            return [body for p, body, _ in self.requests if p == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def every_other_call_fails() -> Answer:
    """Answers 9 (the top score) and fails every second call with a 500, the first one answered."""
    count, lock = itertools.count(), threading.Lock()

    def answer(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        with lock:
            n = next(count)
        return (500, {"error": "judge engine died"}) if n % 2 else (200, chat_reply("9"))

    return answer


if __name__ == "__main__":  # in a container on the stack's agentnet, as a JUDGE_URL endpoint
    parser = argparse.ArgumentParser(description="a stand-in judge: answers 9, fails every other call")
    parser.add_argument("--port", type=int, default=8000)
    judge = FakeJudge(every_other_call_fails(), host="0.0.0.0", port=parser.parse_args().port)
    print(f"stand-in judge ready on port {judge.server.server_address[1]}", flush=True)  # bound: it answers now
    judge.thread.join()
