"""The judge inside real runs, host-only: trainer.train's sync run (real env server process, the real TRL trainer)
and TRL's real async rollout loop (tests/trainer/test_async_rollout_traces.py's, vLLM turns scripted), each with the
`judge` reward function calling a stand-in judge server (tests/trainer/judge_double.py: a test double;
tests/gpu_path/test_judge_twin.py calls the real vLLM)."""

from __future__ import annotations

import itertools
import queue
import threading
from types import SimpleNamespace

import pytest

from tests.trainer.judge_double import FakeJudge, chat_reply, every_other_call_fails
from tests.trainer.test_train_local import base_argv
from trainer.core.metrics import read_metrics
from trainer.rollouts import traces


@pytest.fixture
def fake_judge():
    made = []

    def start(answer):
        made.append(FakeJudge(answer))
        return made[-1]

    yield start
    for server in made:
        server.close()


def test_sync_run_learns_from_the_judge_with_failed_calls_left_out(tmp_path, tiny_model_dir, echo_server, fake_judge,
                                                                  capsys):
    judge = fake_judge(every_other_call_fails())
    argv = base_argv(tiny_model_dir, tmp_path, {"echo": echo_server.url}, "--max-steps", "2",
                     "--per-device-train-batch-size", "4", "--num-generations", "2", "--dataset-size", "8",
                     "--judge-url", judge.url, "--judge-weight", "2", "--env-reward-weight", "0",
                     "--judge-cache-size", "0", "--trace-every", "1", "--trace-samples", "4")
    from trainer import train

    assert train.main(argv) == 0
    rows = read_metrics(tmp_path / "echo")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # the scored half scored 9 (1.0): weighed 2, the env's reward weighed 0
        assert row["rewards/judge/mean"] == 1.0 and row["reward"] == pytest.approx(2.0)
        assert row["judge/calls"] == 4 and row["judge/failures"] == 2 and row["judge/tokens"] == 20
    out = capsys.readouterr().out
    assert "[preflight] ok: judge judge-double at" in out and "judge: rubric (choice) at" in out
    assert " 4 calls 20 tok 0 cached 2 failed" in out
    traced = traces.read(tmp_path / "echo" / traces.ROLLOUTS_FILE)
    failed = [r for r in traced if r["judge"] and r["judge"]["failure"]]
    scored = [r for r in traced if r["judge"] and r["judge"]["failure"] is None]
    assert failed and scored and all(r["reward"] is None for r in failed)
    assert all(r["judge"]["verdict"] == "9" and r["reward"] == 2.0 for r in scored)
    assert len(judge.posts()) == 8 + 1  # two steps of four episodes, and the preflight's test episode
    # the rubric saw each episode's env reward: TRL runs the (async) judge after the env's get_reward column
    assert all("this episode was: none" not in body["messages"][0]["content"] for body in judge.posts()[1:])
    assert all("this episode was: " in body["messages"][0]["content"] for body in judge.posts()[1:])


def test_several_envs_one_unjudged_keeps_its_rows_scored_by_its_env_alone(tmp_path, tiny_model_dir,
                                                                          env_server_factory, fake_judge,
                                                                          monkeypatch):
    """ENV_CATCH_JUDGE=0 beside a judged echo: only echo's episodes are sent to the judge; catch's rows get None from
    `judge`, which TRL's nansum skips, so they keep their env reward (weighed ENV_REWARD_WEIGHT) and stay trained."""
    echo, catch = env_server_factory("echo"), env_server_factory("catch")
    judge = fake_judge(lambda path, body: (200, chat_reply("9")))
    monkeypatch.setenv("ENV_CATCH_JUDGE", "0")
    argv = base_argv(tiny_model_dir, tmp_path, {"echo": echo.url, "catch": catch.url}, "--max-steps", "1",
                     "--per-device-train-batch-size", "8", "--num-generations", "2", "--dataset-size", "8",
                     "--judge-url", judge.url, "--judge-cache-size", "0", "--trace-every", "1", "--trace-samples", "8")
    from trainer import train

    assert train.main(argv) == 0
    [row] = read_metrics(tmp_path / "echo+catch")
    assert row["rewards/judge/mean"] == 1.0 and "rewards/CatchTool/mean" in row and "rewards/EchoTool/mean" in row
    traced = traces.read(tmp_path / "echo+catch" / traces.ROLLOUTS_FILE)  # the whole batch (TRACE_SAMPLES=8)
    echo_rows = [r for r in traced if r["env"] == "echo"]
    catch_rows = [r for r in traced if r["env"] == "catch"]
    assert echo_rows and catch_rows and len(traced) == 8
    assert all(r["judge"]["verdict"] == "9" and r["rewards"]["judge"] == 1.0 for r in echo_rows)
    for r in catch_rows:  # not judged, not left out: scored by its env (and the unfinished penalty)
        assert r["judge"] is None and r["rewards"]["judge"] is None and r["reward"] is not None
        assert r["rewards"]["CatchTool"] == r["env_reward"]
    assert row["judge/calls"] == len(echo_rows) == len(judge.posts()) - 1  # - the preflight's test episode


def test_two_trainer_processes_leave_out_their_failed_judge_rows_together(tmp_path, tiny_model_dir, echo_server,
                                                                         fake_judge):
    """TRAINER_PROCESSES=2 on CPU (trainer.launch, gloo): each process judges its own rows; the failed ones are gathered
    so that every process NaNs the same rows (a process that did not would leave a collective waiting)."""
    import os
    import subprocess
    import sys

    from tests.trainer.test_train_local import ROOT

    judge = fake_judge(every_other_call_fails())
    argv = base_argv(tiny_model_dir, tmp_path, {"echo": echo_server.url}, "--max-steps", "2",
                     "--per-device-train-batch-size", "4", "--num-generations", "2", "--dataset-size", "8",
                     "--trainer-processes", "2", "--judge-url", judge.url, "--judge-weight", "2",
                     "--env-reward-weight", "0", "--judge-cache-size", "0")
    ran = subprocess.run([sys.executable, "-m", "trainer.launch", *argv], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=1800)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    rows = read_metrics(tmp_path / "echo")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rewards/judge/mean"] == 1.0 and r["reward"] == pytest.approx(2.0) for r in rows), rows
    assert len(judge.posts()) == 2 * 8 + 1  # both processes' rows, each step, and the preflight's test episode


def test_sync_run_stops_with_exit_78_when_the_judge_stays_down(tmp_path, tiny_model_dir, echo_server, fake_judge,
                                                               capsys):
    """Preflight passes (the judge answers then), then every call fails: past JUDGE_DOWN_AFTER_S (1 ms: any step
    takes longer) the run stops in one line."""
    calls = itertools.count()
    judge = fake_judge(lambda path, body: (200, chat_reply("5")) if next(calls) == 0 else (503, {"error": "down"}))
    argv = base_argv(tiny_model_dir, tmp_path, {"echo": echo_server.url}, "--max-steps", "4",
                     "--per-device-train-batch-size", "4", "--num-generations", "2", "--dataset-size", "8",
                     "--judge-url", judge.url, "--judge-down-after-s", "0.001", "--judge-cache-size", "0")
    from trainer import train

    assert train.main(argv) == 78
    err = capsys.readouterr().err
    assert "[train] stopped: the judge failed all of its last" in err and "judge server error" in err


def test_async_worker_weighs_the_judge_and_drops_a_failed_call_from_the_group(tmp_path, tiny_model_dir, echo_server,
                                                                             fake_judge):
    """Groups of two, scored one after another: one call of each fails (the judge double fails every other one). The
    failed episode never reaches the trainer and is out of its group's baseline (the other's advantage is 0); the
    kept one's reward is JUDGE_WEIGHT x judge + ENV_REWARD_WEIGHT x the env's."""
    from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

    from tests.trainer.worker_loops import ScriptedTurnsLoop, close, drained, echo_worker_loop, run_loop
    from trainer.core import async_metrics
    from trainer.judge.costs import COSTS
    from trainer.judge.reward import judge_reward
    from trainer.judge.setup import JudgeSetup

    judge = fake_judge(every_other_call_fails())
    setup = JudgeSetup(base_url=judge.url, method="rubric", score="choice", template="{transcript}",
                       judged_envs=frozenset({"echo"}), concurrency=2, timeout_s=60.0, down_after_s=3600.0,
                       max_tokens=4, cache_size=0, num_generations=2, model="m")
    COSTS.drain()  # a run earlier in this process counted its own (the worker's spawned process starts with none)
    loop = echo_worker_loop(ScriptedTurnsLoop, tmp_path, tiny_model_dir, echo_server.url,
                            reward_funcs=[judge_reward(setup)], reward_weights=(("judge",), 2.0, 0.5))
    try:
        run_loop(loop, samples_wanted=2)
    finally:
        close(loop)
    samples, sink = drained(loop)
    groups = len(sink["judge/failures_total"])
    assert groups >= 2 and sink["judge/failures_total"] == [1.0] * groups and len(samples) == groups
    for sample in samples:
        assert sample.metrics["rewards/judge"] == 1.0 and sample.advantage == 0.0
        assert sample.metrics["reward"] == pytest.approx(2.0 + 0.5 * sample.metrics["rewards/EchoTool"])
    record = async_metrics.record({k: _reduce_metric(k, v) for k, v in sink.items()})
    assert record["judge/failures"] == groups and record["judge/calls"] == 2 * groups
    traced = traces.read(tmp_path / traces.ROLLOUTS_FILE)
    assert sorted(bool(r["judge"]["failure"]) for r in traced) == [False, True]
    assert [r["reward"] for r in traced if r["judge"]["failure"]] == [None]


def test_a_judge_down_in_the_rollout_worker_stops_the_trainer_with_its_line():
    """The worker's `judge` raises JudgeDown; TRL's child reports (type, message, traceback) and sets its failed
    event; the trainer's health check raises that JudgeDown, one line, which trainer.train turns into exit 78."""
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trainer.async_grpo.async_run import stop_on_env_or_vllm_down
    from trainer.judge.costs import JudgeDown

    worker = object.__new__(AsyncRolloutWorker)  # TRL's class (its __init__ wants vLLM installed)
    worker._failed_event, worker._exception_info_queue = threading.Event(), queue.Queue()
    worker._heartbeat_value, worker._process = SimpleNamespace(value=0.0), None
    worker._failed_event.set()
    worker._exception_info_queue.put(("JudgeDown", "the judge failed all of its last 9 calls over 301 s", "tb"))
    stop_on_env_or_vllm_down(worker)
    with pytest.raises(JudgeDown, match="the judge failed all of its last 9 calls"):
        worker.check_health(300.0)


def test_sync_run_on_an_env_learned_from_its_server_is_judged_and_failed_calls_are_left_out_stand_in_judge(
        tmp_path, tiny_model_dir, fake_judge, capsys):
    """An env the stack learns from its server (envs.generic): the `notebook` fixture, the app its image serves
    (tests/fixtures/envs, tests/envs/test_generic_containers.py), here as a local process. The judge is a stand-in
    that answers 9 and fails every other call: its task reaches it as the reset gave it (appended to the prompt), a
    failed call leaves its row out (a 0 would pull rewards/judge/mean to ~0.5; it stays 1.0)."""
    from tests.helpers import free_port, start_fixture

    port = free_port()
    server = start_fixture("notebook", port)
    judge = fake_judge(every_other_call_fails())
    try:
        argv = base_argv(tiny_model_dir, tmp_path, {"notebook": f"http://127.0.0.1:{port}"}, "--max-steps", "1",
                         "--per-device-train-batch-size", "4", "--num-generations", "2", "--dataset-size", "4",
                         "--judge-url", judge.url, "--judge-cache-size", "0", "--trace-every", "1",
                         "--trace-samples", "4")
        from trainer import train

        assert train.main(argv) == 0
    finally:
        server.kill()
        server.wait()
    [row] = read_metrics(tmp_path / "notebook")
    assert row["judge/calls"] == 4 and row["judge/failures"] == 2 and row["rewards/judge/mean"] == 1.0, row
    assert " 4 calls 20 tok 0 cached 2 failed" in capsys.readouterr().out
    prompts = [body["messages"][0]["content"] for body in judge.posts()[1:]]  # after the preflight's test episode
    assert len(prompts) == 4 and all("task: Write the word " in p for p in prompts), prompts[:1]
    traced = traces.read(tmp_path / "notebook" / traces.ROLLOUTS_FILE)
    failed = [r for r in traced if r["judge"]["failure"]]
    assert len(traced) == 4 and len(failed) == 2
    assert all(r["reward"] is None and r["judge"]["score"] is None for r in failed)  # left out, not 0
    assert all(r["judge"]["score"] == 1.0 and r["rewards"]["judge"] == 1.0 for r in traced if r not in failed)
