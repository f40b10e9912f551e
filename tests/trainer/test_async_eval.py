"""#66 item 1, ROLLOUTS=async: evaluation during training (trainer.run.evaluation.AsyncEvalCallback over
trainer.async_grpo.async_eval.EpisodePlayer): the stack's async rollout loop (StackRolloutLoop over TRL 1.16's real
loop) built from the worker's settings, playing held-out tasks of a real env server in this process (the Task API
fixture `sums`, through the real env binding) greedily, against a stub of vLLM's /v1/completions (no vLLM on a
host: the one stand-in, scripted to answer each sum in plain text, right for the even first digits only). Checked:
the figures, greedy requests, the final answer submitted through the env's answer tool (item 2, async), the sessions
freed after each evaluation, TRL's weight push put before the evaluation, and EVAL_EVERY accepted with async."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from accelerate.state import PartialState
from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo import async_grpo_trainer as trl_async
from trl.experimental.async_grpo import async_rollout_worker as trl_worker

from contract.config import RunConfig
from envs.core.tool import session_of
from envs.generic import GenericSpec
from tests.envs.inprocess import ThreadServer
from tests.trainer.test_async_episode_budget import ClientError, Reply
from trainer.async_grpo.async_eval import EpisodePlayer
from trainer.async_grpo.async_trainer import StackRolloutLoop
from trainer.core.metrics import RolloutStats
from trainer.core.trl_privates import environment_pool
from trainer.rollouts.envs_binding import EnvFactory, tool_class_source
from trainer.run.evaluation import AsyncEvalCallback
from trainer.run.held_out import held_out

APP = Path(__file__).resolve().parents[1] / "fixtures" / "envs" / "sums" / "app.py"
SUM = re.compile(r"What is (\d)\+(\d)\?")


class GreedySums:
    """vLLM's /v1/completions, scripted: the sum in the prompt's last question, in plain text; right when its first
    digit is even, one off otherwise. Records every request's payload."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.payloads = tokenizer, []

    def post(self, url, json, timeout):
        assert url.endswith("/v1/completions")
        self.payloads.append(json)
        a, b = map(int, SUM.findall(self.tokenizer.decode(json["prompt"]))[-1])
        text = f"{a + b if a % 2 == 0 else a + b + 1}<|im_end|>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:json["max_tokens"]]
        return Reply(200, {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.1] * len(ids)}}]})


@pytest.fixture
def sums_server():
    found = importlib.util.spec_from_file_location("fixture_sums_async_eval", APP)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    with ThreadServer("sums", app=module.app) as server:
        yield server, module.TASKS


@pytest.fixture
def stub_aiohttp(monkeypatch):
    PartialState()
    aiohttp = SimpleNamespace(ClientTimeout=lambda total: total, ClientError=ClientError)
    monkeypatch.setitem(sys.modules, "aiohttp", aiohttp)
    monkeypatch.setattr(trl_worker, "aiohttp", aiohttp, raising=False)
    monkeypatch.setattr(trl_worker, "_RETRYABLE_HTTP_ERRORS", (ClientError,), raising=False)


def test_async_eval_plays_held_out_tasks_greedily_and_frees_its_sessions(sums_server, stub_aiohttp, tiny_model_dir,
                                                                         tmp_path):
    server, tasks = sums_server
    cfg = RunConfig.load(["--rollouts", "async", "--train-mode", "gpu", "--env-name", "sums", "--eval-every", "2",
                          "--eval-episodes", "4", "--per-device-train-batch-size", "2", "--num-generations", "2", "--output-dir", str(tmp_path),
                          "--run-name", "r"])
    assert cfg.rollouts.eval_sessions(cfg) == 2 and cfg.sessions_needed("sums") == cfg.rollouts.inflight(cfg, 1) + 2
    spec = GenericSpec.discover("sums", server.url)
    stats = RolloutStats()
    factory = EnvFactory("sums", tool_class_source(spec), server.url, stats, 2000, 30.0, 30.0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    worker_kwargs = dict(model_name="tiny", dataset=Dataset.from_list([{"prompt": "unused"}]), reward_funcs=[],
                         processing_class=tokenizer, eos_token_ids=[stop], environment_factory=factory,
                         num_generations=4, max_inflight_tasks=8, max_tokens=32, temperature=1.0,
                         request_seeds=False, tool_timeout_s=30.0)
    vllm = GreedySums(tokenizer)
    player = EpisodePlayer(StackRolloutLoop, worker_kwargs, SimpleNamespace(value=3), 2, session=vllm)
    callback = AsyncEvalCallback(cfg, held_out(cfg, {"sums": spec}, 4), stats, print_fn=lambda line: None)
    sync = trl_async.StepIntervalCallback(lambda: None, 1)
    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=["metrics", callback, "control", sync]),
                              accelerator=SimpleNamespace(num_processes=1))
    callback.bind(trainer, player)
    assert trainer.callback_handler.callbacks == ["metrics", sync, callback, "control"]  # push, then evaluate
    try:
        for _ in range(2):  # two evaluations: the sessions of the first are reopened by the second
            record = callback.evaluate()
            right = [int(t["question"][8]) % 2 == 0 for t in tasks["test"]]  # "What is a+b?": a even -> right
            assert record["eval/sums/episodes"] == 4 and record["eval/sums/infra_failures"] == 0
            assert record["eval/sums/reward_mean"] == pytest.approx(sum(right) / 4) and 0 < sum(right) < 4
            assert record["eval/sums/tool_calls_per_episode"] == 0  # the stack's submission is not the model's call
            pool = environment_pool(player.loop)[None]
            assert 1 <= len(pool) <= 2 + 1 and all(session_of(env)._ws is None for env in pool)  # freed
        assert {p["temperature"] for p in vllm.payloads} == {0.0} and {p["model"] for p in vllm.payloads} == {"tiny"}
        questions = [tokenizer.decode(p["prompt"]) for p in vllm.payloads]
        assert all("solution" not in q for q in questions)
        assert sorted(SUM.findall(q)[-1] for q in questions[:4]) == sorted(SUM.findall(t["question"])[0]
                                                                          for t in tasks["test"])
        assert stats.drain()[1] == {}  # the evaluation's episodes went to an account set apart, not the step's
    finally:
        callback.on_train_end(SimpleNamespace(), SimpleNamespace(is_world_process_zero=True), SimpleNamespace())
    assert callback.player is None


def test_eval_every_is_a_setting_of_both_rollouts_modes():
    cfg = RunConfig.load(["--rollouts", "async", "--train-mode", "gpu", "--eval-every", "10", "--eval-episodes", "3"])
    assert cfg.rollouts.eval_every == 10 and cfg.rollouts.eval_sessions(cfg) == 3
    assert "+ 3 for EVAL_EVERY's episodes" in cfg.rollouts.inflight_rule(cfg)
    off = RunConfig.load(["--rollouts", "async", "--train-mode", "gpu"])
    assert off.rollouts.eval_sessions(off) == 0 and off.sessions_needed("echo") == cfg.sessions_needed("echo") - 3
    json.dumps(cfg.model_dump(mode="json"))  # run.json records it


def test_an_async_step_record_carries_the_evaluation_figures(tmp_path):
    """The async step record (MetricsCallback's, from TRL's async logs) takes the eval/... figures the callback left
    for its step, as the sync record does (a rehearsal run first wrote none)."""
    from contract.config import GpuMode
    from contract.config.rollouts import rollouts_variant
    from trainer.core.metrics import MetricsCallback, read_metrics

    stats = RolloutStats()
    callback = MetricsCallback(str(tmp_path), stats, mode=GpuMode(), rollouts=rollouts_variant("async"),
                               print_fn=lambda line: None)
    stats.add_figures({"eval/echo/reward_mean": 0.75, "eval/reward": 0.75, "time/eval_s": 1.5})
    state = SimpleNamespace(global_step=2, is_world_process_zero=True, max_steps=4)
    callback.on_log(SimpleNamespace(max_steps=4), state, SimpleNamespace(), logs={"loss": 0.1})
    [row] = read_metrics(tmp_path)
    assert row["rollouts"] == "async" and row["eval/echo/reward_mean"] == 0.75 and row["time/eval_s"] == 1.5
