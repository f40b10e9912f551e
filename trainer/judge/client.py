"""The judge's HTTP side: an OpenAI-compatible endpoint (vLLM's, or JUDGE_URL's), over httpx (in both trainer images;
the `openai` client is not). Every way a call can fail becomes JudgeFailure with one line saying why, never a score:
a timeout, a refused or lost connection, a 5xx or 4xx, a body that is not JSON.

The key (JUDGE_URL's) is read from the secret file when it exists and sent as a bearer token; it is kept out of every
message this module makes (httpx's errors name the URL, never headers)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx

from envs.core.untrusted import one_line, strip_credentials

REASON_CHARS = 300
MAX_REPLY_BYTES = 1 << 20  # a judge reply is a few hundred tokens; a huge body is an error, not a verdict


class JudgeFailure(Exception):
    """A judge call that produced no score: the row is left out of the loss (trainer.judge.leave_out)."""

    def __init__(self, reason: str) -> None:
        super().__init__(one_line(strip_credentials(reason), REASON_CHARS))
        self.reason = str(self)


def read_key(path: str) -> str | None:
    try:
        key = Path(path).read_text().strip()
    except OSError:
        return None
    return key or None


class JudgeClient:
    """One per process and setup (`client_for`): httpx's pooled client is thread-safe."""

    def __init__(self, base_url: str, root_url: str, timeout_s: float, api_key_file: str, connections: int) -> None:
        self.base_url, self.root_url, self.timeout_s = base_url, root_url, timeout_s
        key = read_key(api_key_file)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers, trust_env=False,
                                  limits=httpx.Limits(max_connections=connections))

    def post(self, path: str, payload: dict[str, Any], root: bool = False) -> dict[str, Any]:
        return self._request("POST", path, payload, root)

    def get(self, path: str, root: bool = False) -> dict[str, Any]:
        return self._request("GET", path, None, root)

    def _request(self, method: str, path: str, payload: dict[str, Any] | None, root: bool) -> dict[str, Any]:
        url = f"{self.root_url if root else self.base_url}{path}"
        try:
            response = self._http.request(method, url, json=payload)
        except httpx.TimeoutException:
            raise JudgeFailure(f"judge timeout: no reply from {url} within JUDGE_TIMEOUT_S={self.timeout_s:g} s") \
                from None
        except httpx.HTTPError as exc:
            raise JudgeFailure(f"judge unreachable: {type(exc).__name__} at {url}: {exc}") from None
        body = response.content[:MAX_REPLY_BYTES + 1]
        if response.status_code >= 400:
            kind = "judge server error" if response.status_code >= 500 else "judge refused the request"
            raise JudgeFailure(f"{kind}: {method} {url} answered {response.status_code} {body[:200]!r}")
        if len(body) > MAX_REPLY_BYTES:
            raise JudgeFailure(f"judge reply over {MAX_REPLY_BYTES} bytes from {url}")
        try:
            data = json.loads(body)
        except ValueError:
            raise JudgeFailure(f"judge reply is not JSON: {body[:200]!r}") from None
        if not isinstance(data, dict):
            raise JudgeFailure(f"judge reply is not a JSON object: {body[:200]!r}")
        return data

    def served_model(self) -> tuple[str, int | None]:
        """(the first model id the endpoint lists, its max_model_len where vLLM says it) from /v1/models."""
        data = self.get("/models").get("data")
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or not data[0].get("id"):
            raise JudgeFailure(f"{self.base_url}/models lists no model")
        length = data[0].get("max_model_len")
        return str(data[0]["id"]), int(length) if isinstance(length, int) else None

    def close(self) -> None:
        self._http.close()


_CLIENTS: dict[tuple, JudgeClient] = {}
_LOCK = threading.Lock()


def client_for(base_url: str, root_url: str, timeout_s: float, api_key_file: str, connections: int) -> JudgeClient:
    """This process's client for these settings (the async worker builds its own after the spawn)."""
    key = (base_url, root_url, timeout_s, api_key_file, connections)
    with _LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = JudgeClient(base_url, root_url, timeout_s, api_key_file, connections)
        return _CLIENTS[key]
