"""A round of tool calls runs at once, bounded by TOOL_CONCURRENCY and TOOL_TIMEOUT_S: shown on a real env server.

The fixture env (tests/fixtures/envs/rendezvous) counts the sessions inside its tool at once, and its tool
waits until ROUND_SIZE of them are there together: a loop that calls rollouts one after another would meet
nobody. Everything between the trainer and the server is the stack's own path (the env learned from /schema,
bound by trainer.envs_binding, driven by train.py's trainer class); only the model's turns are scripted: each
rollout calls `meet` once, then answers.
"""

from __future__ import annotations

import json

import pytest
import requests

from tests.helpers import free_port, start_fixture

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


def make_trainer(url, tiny_model_dir, tmp_path, *extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer import preflight
    from trainer.config import RunConfig
    from trainer.envs_binding import build_factories
    from trainer.train import build_dataset, make_trainer_class

    cfg = RunConfig.load(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(tmp_path),
                          "--env-name", "rendezvous", "--env-urls", f"rendezvous={url}", "--num-generations", "2",
                          "--per-device-train-batch-size", str(BATCH), "--max-completion-length", "128",
                          "--dataset-size", "8", *extra])
    specs = preflight.resolve_envs(cfg).specs
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = make_trainer_class()(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), args=cfg.to_grpo_config("cpu"),
        train_dataset=build_dataset(cfg, specs), processing_class=tokenizer,
        environment_factory=build_factories(cfg, specs))
    trainer.configure_tools(cfg.tool_timeout_s, cfg.tool_concurrency)
    return trainer, tokenizer


def script(trainer, tokenizer, texts: list[str]):
    """First turn: rollout k calls meet(texts[k]); every later turn answers."""

    def turn(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if len(prompt_ids) == BATCH and "<tool_response>" not in tokenizer.decode(prompt_ids[0]):
            return [turn('<tool_call>\n' + json.dumps({"name": "meet", "arguments": {"text": t}}) + '\n</tool_call>')
                    for t in texts], None
        return [turn("Done.") for _ in prompt_ids], None

    trainer._generate_single_turn = generate


def run_batch(trainer) -> tuple:
    """One generation batch through TRL's scoring path; returns what the loop returned."""
    returned = []
    original = trainer._tool_call_loop

    def recording(*args):
        returned.append(original(*args))
        return returned[-1]

    trainer._tool_call_loop = recording
    row = dict(trainer.train_dataset[0])
    trainer._generate_and_score_completions([row] * BATCH)
    trainer._tool_call_loop = original
    return returned[0]


def tool_results(completions) -> list[str]:
    return [next(m["content"] for m in c if m["role"] == "tool") for c in completions]


def test_the_whole_round_is_inside_the_env_at_once(rendezvous, tiny_model_dir, tmp_path):
    url = rendezvous(ROUND_SIZE=str(BATCH))
    trainer, tokenizer = make_trainer(url, tiny_model_dir, tmp_path)
    script(trainer, tokenizer, [f"r{k}" for k in range(BATCH)])
    _, completions, _, _, calls, failures, _ = run_batch(trainer)
    assert stats(url)["peak"] == BATCH and stats(url)["calls"] == BATCH
    assert (calls, failures) == (BATCH, 0)
    assert tool_results(completions) == [f"met r{k}" for k in range(BATCH)]  # each rollout got its own answer


def test_tool_concurrency_bounds_the_calls_in_flight(rendezvous, tiny_model_dir, tmp_path):
    url = rendezvous(ROUND_SIZE="2")
    trainer, tokenizer = make_trainer(url, tiny_model_dir, tmp_path, "--tool-concurrency", "2")
    script(trainer, tokenizer, [f"r{k}" for k in range(BATCH)])
    _, completions, _, _, calls, failures, _ = run_batch(trainer)
    assert stats(url)["peak"] == 2 and stats(url)["calls"] == BATCH
    assert trainer.tool_runner.peak_in_flight == 2
    assert tool_results(completions) == [f"met r{k}" for k in range(BATCH)]


def test_a_call_past_the_timeout_fails_and_its_session_is_replaced(rendezvous, tiny_model_dir, tmp_path):
    from trainer.metrics import STATS
    from trainer.rollout_loop import TIMEOUT_ERROR

    url = rendezvous(HOLD_S="600")  # "hang" holds its call for 10 minutes
    trainer, tokenizer = make_trainer(url, tiny_model_dir, tmp_path, "--tool-timeout-s", "2")
    script(trainer, tokenizer, ["hang"] + ["ok"] * (BATCH - 1))
    STATS.drain()
    _, completions, _, _, calls, failures, _ = run_batch(trainer)
    results = tool_results(completions)
    assert results[0] == str({"error": TIMEOUT_ERROR.format(name="meet", seconds=2)})
    assert results[1:] == ["met ok"] * (BATCH - 1)  # the others were not held up by it
    assert (calls, failures) == (BATCH, 1)
    hung_env = trainer.environments[0]
    assert not hung_env._client.connected, "the hung call's session must be closed"
    _, episodes = STATS.drain()
    assert sorted(e["tool_failures"] for e in episodes["rendezvous"]) == [0] * (BATCH - 1) + [1]

    # The next episode of that rollout slot opens a fresh session and works.
    script(trainer, tokenizer, ["ok"] * BATCH)
    _, completions, _, _, calls, failures, _ = run_batch(trainer)
    assert trainer.environments[0] is hung_env and hung_env._client.connected
    assert tool_results(completions) == ["met ok"] * BATCH and failures == 0
