"""ROLLOUTS=async never waits silently for a sample (async_run.stop_on_env_or_vllm_down with GENERATION_TIMEOUT_S).

TRL's rollout worker retries a generation that timed out up to 90 times, and its heartbeat stays fresh meanwhile, so a
vLLM that takes requests and answers none held a run silent for hours. Past GENERATION_TIMEOUT_S without a sample the
trainer reads vLLM's state and stops with one line: paused, or requests held with no token made, is a vLLM gone (exit
77: `make train` restarts it and resumes); vLLM idle is a stuck worker; vLLM still making tokens is waited on.

The stand-in vLLM answers the two routes read as vLLM 0.31 does (read on the CPU twin, `make rehearse`, 2026-12-06):
GET /is_paused -> {"is_paused": false} (a dev route, VLLM_SERVER_DEV_MODE=1), and /metrics in Prometheus text with one
sample per engine, e.g. `vllm:num_requests_running{engine="0",model_name="/models/tiny-qwen3"} 0.0` and
`vllm:generation_tokens_total{engine="0",model_name="/models/tiny-qwen3"} 2.0`."""

from __future__ import annotations

import queue
import threading
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import pytest

from tests.helpers import JsonStubHandler, stub_http_server

STATE = {"paused": False, "running": 0.0, "waiting": 0.0, "tokens": 2.0}
MODEL = 'engine="0",model_name="/models/tiny-qwen3"'


class FakeVLLM(JsonStubHandler, BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/is_paused":
            return self.reply(200, {"is_paused": STATE["paused"]})
        if self.path == "/metrics":
            body = "\n".join([
                "# HELP vllm:num_requests_running Number of requests in model execution batches.",
                "# TYPE vllm:num_requests_running gauge",
                f"vllm:num_requests_running{{{MODEL}}} {STATE['running']}",
                f"vllm:num_requests_waiting{{{MODEL}}} {STATE['waiting']}",
                f'vllm:num_requests_waiting_by_reason{{{MODEL},reason="capacity"}} 0.0',
                f"vllm:generation_tokens_total{{{MODEL}}} {STATE['tokens']}",
                "process_start_time_seconds 1.79653692324e+09", ""]).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            return self.wfile.write(body)
        return self.reply(404, {})


@pytest.fixture
def vllm():
    STATE.update(paused=False, running=0.0, waiting=0.0, tokens=2.0)
    with stub_http_server(FakeVLLM) as url:
        yield url


def waiting_worker(url: str):
    """TRL's worker (its __init__ wants vLLM installed) with the parts the health check reads: a fresh heartbeat, a
    live process, an empty samples queue; the bound set so small that the second empty poll is past it."""
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trainer.async_grpo.async_run import stop_on_env_or_vllm_down

    worker = object.__new__(AsyncRolloutWorker)
    worker._failed_event, worker._exception_info_queue = threading.Event(), queue.Queue(maxsize=1)
    worker._heartbeat_value = SimpleNamespace(value=__import__("time").time())
    worker._process = SimpleNamespace(pid=4242, exitcode=None, is_alive=lambda: True)
    worker.rollout_buffer = queue.Queue()
    stop_on_env_or_vllm_down(worker, url, no_sample_s=1e-9)
    return worker


def test_a_paused_vllm_stops_the_wait_as_a_vllm_gone(vllm):
    from trainer.gpu.server import VLLMGone, went_away

    worker = waiting_worker(vllm)
    worker.check_health(300.0)  # the wait begins
    STATE["paused"] = True
    with pytest.raises(VLLMGone, match="stayed paused") as gone:
        worker.check_health(300.0)
    assert went_away(gone.value, vllm) == str(gone.value)  # trainer.run.training: exit 77, make train restarts vLLM


def test_requests_held_with_no_token_made_stop_the_wait(vllm):
    from trainer.gpu.server import VLLMGone

    worker = waiting_worker(vllm)
    STATE.update(running=3.0, waiting=2.0)
    worker.check_health(300.0)
    with pytest.raises(VLLMGone, match=r"holds 5 request\(s\) and made no token"):
        worker.check_health(300.0)


def test_a_vllm_still_generating_is_waited_on_and_an_idle_one_means_a_stuck_worker(vllm, capsys):
    worker = waiting_worker(vllm)
    STATE.update(running=4.0)
    worker.check_health(300.0)
    STATE["tokens"] = 500.0  # long episodes, still going
    worker.check_health(300.0)
    assert "vLLM is generating (498 tokens meanwhile)" in capsys.readouterr().out
    STATE.update(running=0.0)  # nothing asked of vLLM, no sample either
    with pytest.raises(RuntimeError, match="rollout worker is stuck"):
        worker.check_health(300.0)


def test_a_vllm_that_answers_nothing_stops_the_wait_as_a_vllm_gone():
    from trainer.gpu.server import VLLMGone

    with stub_http_server(FakeVLLM) as url:
        worker = waiting_worker(url)
        worker.check_health(300.0)
    with pytest.raises(VLLMGone, match="answered neither"):  # its port closed now: nothing answers
        worker.check_health(300.0)


def test_a_sample_taken_starts_the_next_wait_afresh(vllm):
    worker = waiting_worker(vllm)
    worker.check_health(300.0)
    STATE["paused"] = True  # paused now: past the bound this wait would stop the run
    worker.rollout_buffer.put("sample")
    assert worker.rollout_buffer.get(timeout=1) == "sample"  # as TRL's RolloutQueueDataset takes it
    worker.check_health(300.0)  # a new wait: it begins here, nothing raised


def test_without_a_bound_the_wait_is_trls_own(vllm):
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trainer.async_grpo.async_run import stop_on_env_or_vllm_down

    worker = object.__new__(AsyncRolloutWorker)
    worker._failed_event, worker._exception_info_queue = threading.Event(), queue.Queue(maxsize=1)
    worker._heartbeat_value = SimpleNamespace(value=__import__("time").time())
    worker._process = None
    worker.rollout_buffer = queue.Queue()
    STATE["paused"] = True
    stop_on_env_or_vllm_down(worker, vllm, no_sample_s=None)
    for _ in range(3):
        worker.check_health(300.0)
