"""A round of tool calls runs at once, bounded by TOOL_CONCURRENCY and TOOL_TIMEOUT_S: shown on a real env server.

The fixture env (tests/fixtures/envs/rendezvous) counts the sessions inside its tool at once, and its tool
waits until ROUND_SIZE of them are there together: a loop that calls rollouts one after another would meet
nobody. Everything between the trainer and the server is the stack's own path (the env learned from /schema,
bound by trainer.rollouts.envs_binding, driven by train.py's trainer class); only the model's turns are scripted: each
rollout calls `meet` once, then answers.
"""

from __future__ import annotations

import pytest
import requests

from tests.helpers import free_port, start_fixture
from tests.trainer.scripted import make_trainer, run_batch, script

BATCH = 8


@pytest.fixture
def rendezvous():
    procs = []

    def start(**env: str) -> str:
        port = free_port()
        procs.append(start_fixture("rendezvous", port, **env))
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def stats(url: str) -> dict:
    return requests.get(url + "/fixture/stats", timeout=10).json()


def tool_results(completions) -> list[str]:
    return [next(m["content"] for m in c if m["role"] == "tool") for c in completions]


def test_the_whole_round_is_inside_the_env_at_once(rendezvous, tiny_model_dir, tmp_path):
    url = rendezvous(ROUND_SIZE=str(BATCH))
    trainer, tokenizer = make_trainer(url, tiny_model_dir, tmp_path, BATCH)
    script(trainer, tokenizer, [f"r{k}" for k in range(BATCH)])
    _, completions, _, _, calls, failures, _ = run_batch(trainer)
    assert stats(url)["peak"] == BATCH and stats(url)["calls"] == BATCH
    assert (calls, failures) == (BATCH, 0)
    assert tool_results(completions) == [f"met r{k}" for k in range(BATCH)]  # each rollout got its own answer


def test_tool_concurrency_bounds_the_calls_in_flight(rendezvous, tiny_model_dir, tmp_path):
    url = rendezvous(ROUND_SIZE="2")
    trainer, tokenizer = make_trainer(url, tiny_model_dir, tmp_path, BATCH, "--tool-concurrency", "2")
    script(trainer, tokenizer, [f"r{k}" for k in range(BATCH)])
    _, completions, _, _, calls, failures, _ = run_batch(trainer)
    assert stats(url)["peak"] == 2 and stats(url)["calls"] == BATCH
    assert trainer.tool_runner.peak_in_flight == 2
    assert tool_results(completions) == [f"met r{k}" for k in range(BATCH)]


def test_a_call_past_the_timeout_fails_and_its_session_is_replaced(rendezvous, tiny_model_dir, tmp_path):
    from trainer.core.metrics import STATS
    from trainer.rollouts.rollout_loop import TIMEOUT_ERROR

    url = rendezvous(HOLD_S="600")  # "hang" holds its call for 10 minutes
    trainer, tokenizer = make_trainer(url, tiny_model_dir, tmp_path, BATCH, "--tool-timeout-s", "10")
    script(trainer, tokenizer, ["hang"] + ["ok"] * (BATCH - 1))
    STATS.drain()
    STATS.drain_infra_failures()
    _, completions, _, _, calls, failures, _ = run_batch(trainer)
    results = tool_results(completions)
    assert results[0] == str({"error": TIMEOUT_ERROR.format(name="meet", seconds=10)})
    assert results[1:] == ["met ok"] * (BATCH - 1)  # the others were not held up by it
    assert (calls, failures) == (BATCH, 1)
    hung_env = trainer.environments[0]
    assert not hung_env._client.connected, "the hung call's session must be closed"
    _, episodes = STATS.drain()
    assert sorted(e["tool_failures"] for e in episodes["rendezvous"]) == [0] * (BATCH - 1)
    # the hung episode: a reply that never came is the env side's failure, counted apart (trainer.rollouts.infra_failures)
    assert STATS.drain_infra_failures() == {"rendezvous": 1}
    assert hung_env._infra_failure.startswith("no reply within TOOL_TIMEOUT_S (10 s)")

    # The next episode of that rollout slot opens a fresh session and works.
    script(trainer, tokenizer, ["ok"] * BATCH)
    _, completions, _, _, calls, failures, _ = run_batch(trainer)
    assert trainer.environments[0] is hung_env and hung_env._client.connected
    assert tool_results(completions) == ["met ok"] * BATCH and failures == 0
