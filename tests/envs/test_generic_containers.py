"""Any OpenEnv image, trained by naming it in `.env` (no file of the repo edited), on real containers.

The fixture envs (tests/fixtures/envs) are built as images, as a user's OpenEnv images would be, and
driven only through an env file and `python -m tools train` (what `make train` runs):
  * notebook (MCP tools) + guess (typed action, ONE session per container) in one CPU run: the trainer
    learns both interfaces from the servers, the tiny model is warm-started on their tools, tool
    calls and per-env rewards land in metrics.jsonl;
  * the same run has a judge, added by two lines of the env file (JUDGE_URL, JUDGE_CACHE_SIZE=0): its scores land
    (rewards/judge/mean, the judge's record in rollouts.jsonl), the task and transcript of an env learned from its
    image reach it, and its failed calls leave their rows out instead of scoring them 0;
  * guess (one session per container) needs no replica count: ENV_GUESS_REPLICAS=auto, the default, measures
    one container and runs as many as the run opens sessions;
  * guess with too few replicas set by hand: preflight probes its capacity and says which variable to raise;
  * an image that is no OpenEnv server: one line naming the image.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.helpers import ROOT, EnvFileStack, build_images
from tools.images import local_env_image

pytestmark = [pytest.mark.docker, pytest.mark.slow]

FIXTURES = ROOT / "tests" / "fixtures" / "envs"
RUN = "zero-code"
JUDGE = "judge-double"  # its host name on the stack's agentnet
# The judge's lines in the env file, all of them: a judge elsewhere (JUDGE_URL), every episode a call of its own (the
# cache off, so the double's every-other-call failures fall on rows one for one).
JUDGE_LINES = {"JUDGE_URL": f"http://{JUDGE}:8000/v1", "JUDGE_CACHE_SIZE": "0"}


def fixture_image(name: str) -> str:
    tag = f"grpo-fixture/{name}:local"
    subprocess.run(["docker", "build", "-q", "-f", str(FIXTURES / "Dockerfile"), "-t", tag, str(FIXTURES / name)],
                   check=True, capture_output=True)
    return tag


@pytest.fixture(scope="module")
def images(docker):
    build_images("env-server", "trainer-cpu")
    return {name: fixture_image(name) for name in ("notebook", "guess", "not_openenv")}


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


def start_judge_double(project: str) -> str:
    """The stand-in judge (tests/trainer/judge_double.py run as a script in our env-server image: stdlib only) on the
    stack's agentnet, made before the stack as Compose would make it (Compose then takes it as its own): only the
    trainer reaches it, as it reaches a JUDGE_URL. A stand-in, not the vLLM CPU twin: the twin judging inside the
    stack is the `judge` service (~80 s to start, minutes on a loaded machine), and the suite's shared twin is on a
    network of its own; a double also fails on cue, which a real judge does not. The real judge's calls:
    tests/gpu_path/test_judge_twin.py."""
    network, name = f"{project}_agentnet", f"{project}-{JUDGE}"
    docker("network", "create", "--label", f"com.docker.compose.project={project}",
           "--label", "com.docker.compose.network=agentnet", "--label", "grpo-test=1", network)
    docker("run", "-d", "--name", name, "--label", "grpo-test=1", "--network", network, "--network-alias", JUDGE,
           "--user", "10001:10001", "--cap-drop", "ALL", "--read-only", "--no-healthcheck",  # no /health
           "-v", f"{ROOT / 'tests' / 'trainer' / 'judge_double.py'}:/judge/judge_double.py:ro",
           "--entrypoint", "python3", local_env_image(), "/judge/judge_double.py", "8000")
    return name


def judge_calls(name: str) -> list[dict]:
    """The chat calls the double got, as it printed them: {call, status, prompt}."""
    return [json.loads(line) for line in docker("logs", name).stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def trained(images, tmp_path_factory):
    """One CPU run on notebook + guess, named only in the env file, with a judge added by JUDGE_LINES."""
    stack = EnvFileStack(tmp_path_factory.mktemp("zero-code"), {
        "TRAIN_MODE": "cpu", "ENV_NAME": "notebook,guess", "RUN_NAME": RUN, "MAX_STEPS": "3",
        "ENV_NOTEBOOK_IMAGE": images["notebook"], "ENV_GUESS_IMAGE": images["guess"],  # no ENV_*_REPLICAS: auto
        # 4 rollouts per generation batch: at worst all 4 on guess, 1 per replica
        "PER_DEVICE_TRAIN_BATCH_SIZE": "4", "NUM_GENERATIONS": "2",
        "TRACE_EVERY": "1", "TRACE_SAMPLES": "4",  # every rollout of every step in rollouts.jsonl
        **JUDGE_LINES,
    })
    judge = start_judge_double(stack.project)
    try:
        res = stack.stack("train")
        yield stack, res, judge
    finally:
        docker("rm", "-f", judge, check=False)
        stack.down()
        docker("network", "rm", f"{stack.project}_agentnet", check=False)  # `down` removed it unless it failed


def test_two_envs_named_only_in_the_env_file_train_with_tool_calls_and_rewards(trained):
    stack, res, _ = trained
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "[preflight] ok: env notebook: learned from the server (mcp env): tools write_note(text, tag), " \
           "count_notes(min_length)" in out, out[-8000:]
    assert "[preflight] ok: env guess: learned from the server (action env): tools guess_action(number)" in out
    assert ("env guess: 1 session(s) per container (counted); running 4 container(s) for the 4 sessions this run opens "
            "(ENV_GUESS_REPLICAS=auto, at most ENV_REPLICAS_MAX=16)") in out, out[-8000:]
    assert "env notebook: 4+ session(s) per container (counted); running 1 container(s)" in out
    assert "[preflight] ok: env guess: 4 replica(s) healthy; capacity 4 sessions in all (probed" in out
    assert "demo conversations from the real tool classes of notebook, guess" in out  # the warm-start
    rows = [json.loads(line) for line in stack.read(f"/outputs/{RUN}/metrics.jsonl").splitlines()
            if line.startswith("{")]  # the host says what it does on stdout too
    steps = [r for r in rows if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert sum(r["tools/call_frequency"] for r in steps) > 0, "the model never called a tool"
    keys = set().union(*steps)
    assert {"env/notebook/reward_mean", "env/guess/reward_mean", "rewards/NotebookTool/mean",
            "rewards/GuessTool/mean"} <= keys, sorted(keys)
    print(f"zero-code run: tool calls/episode {[round(r['tools/call_frequency'], 2) for r in steps]}, "
          f"reward {[round(r['reward'], 3) for r in steps]}")


def test_a_judge_added_by_two_env_lines_scores_the_learned_envs_and_its_failed_calls_are_left_out_stand_in_judge(
        trained):
    """The judge is a stand-in (start_judge_double says why); everything else is the stack's: `python -m tools train`
    on the fixture images, the trainer container calling JUDGE_URL. The double answers 9 and fails every other call
    (HTTP 500): a failure scored 0 would pull rewards/judge/mean to ~0.5, a row left out leaves it at 1.0."""
    stack, res, judge = trained
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert len(JUDGE_LINES) <= 3
    assert f"[preflight] ok: judge judge-double at http://{JUDGE}:8000/v1" in out, out[-8000:]
    calls = judge_calls(judge)
    assert calls and calls[0]["status"] == 200 and "Say hello." in calls[0]["prompt"]  # preflight's test episode
    training = calls[1:]
    rows = [json.loads(line) for line in stack.read(f"/outputs/{RUN}/metrics.jsonl").splitlines()
            if line.startswith("{")]
    steps = [r for r in rows if r.get("kind") == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:  # every step judged, each answered call a 9 (1.0), its failed calls in no mean
        assert r["judge/calls"] >= 2 and r["judge/failures"] >= 1 and r["rewards/judge/mean"] == 1.0, r
    assert sum(r["judge/calls"] for r in steps) == len(training)
    assert sum(r["judge/failures"] for r in steps) == sum(c["status"] == 500 for c in training) > 0
    assert re.search(r"judge [\d.]+s \d+ calls \d+ tok 0 cached [1-9]\d* failed", out), out[-4000:]
    # What the judge read of envs learned from their images: each task as its reset gave it (notebook: the reset's
    # metadata; guess: its observation, appended to the prompt), the learned tools' calls and results.
    prompts = [c["prompt"] for c in training]
    assert any("task: Write the word " in p for p in prompts), prompts[:2]
    assert any("hint: I picked a number from 0 to 9." in p for p in prompts), prompts[:2]
    assert any("[assistant calls] " in p for p in prompts) and any("[tool result" in p for p in prompts)
    traced = [json.loads(line) for line in stack.read(f"/outputs/{RUN}/rollouts.jsonl").splitlines() if line.strip()]
    judged = [r for r in traced if r.get("judge")]
    assert len(judged) == len(training), (len(judged), len(training))  # TRACE_SAMPLES=4: every rollout traced
    failed = [r for r in judged if r["judge"]["failure"]]
    scored = [r for r in judged if not r["judge"]["failure"]]
    assert len(failed) == sum(c["status"] == 500 for c in training)
    for r in failed:  # left out: no reward at all, not a 0
        assert r["reward"] is None and r["judge"]["score"] is None and "judge server error" in r["judge"]["failure"]
    for r in scored:
        assert r["judge"]["score"] == 1.0 and r["judge"]["verdict"] == "9" and r["rewards"]["judge"] == 1.0
    assert {r["env"] for r in scored} | {r["env"] for r in failed} == {"notebook", "guess"}
    print(f"judged zero-code run: judge calls/step {[int(r['judge/calls']) for r in steps]}, failed "
          f"{[int(r['judge/failures']) for r in steps]}, rewards/judge/mean {[r['rewards/judge/mean'] for r in steps]}, "
          f"judge s/step {[round(r['judge/seconds'], 2) for r in steps]}")


def test_too_few_replicas_of_a_one_session_image_stop_preflight_with_the_variable_to_raise(trained):
    stack, _, _ = trained
    res = stack.stack("train", env={"ENV_GUESS_REPLICAS": "1", "RUN_NAME": "too-few-replicas"})
    out = res.stdout + res.stderr
    assert res.returncode == 3, out[-4000:]
    assert ("env guess (image grpo-fixture/guess:local): capacity 1 sessions over 1 replica(s) (probed: the server "
            "does not report it) < 4 sessions this trainer opens (PER_DEVICE_TRAIN_BATCH_SIZE 4") in out
    assert "set ENV_GUESS_REPLICAS=4 (this image holds 1 session(s) per container)" in out


def test_an_image_that_is_not_an_openenv_server_is_named(images, tmp_path):
    stack = EnvFileStack(tmp_path, {"TRAIN_MODE": "cpu", "ENV_NAME": "web", "ENV_WEB_IMAGE": images["not_openenv"],
                                    "MAX_STEPS": "1"})
    try:
        res = stack.stack("train")
    finally:
        stack.down()
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert ("cannot learn the tools of web (image grpo-fixture/not_openenv:local): http://env-web:8000/schema "
            "answered 404 without an action schema: not an OpenEnv server") in out, out[-4000:]


def test_env_name_without_an_image_says_what_to_set(tmp_path):
    stack = EnvFileStack(tmp_path, {"TRAIN_MODE": "cpu", "ENV_NAME": "connect4"})
    res = stack.stack("mode")
    assert res.returncode == 2
    assert ("ENV_NAME: 'connect4' is not built in (catch, echo, wordle): to train on any OpenEnv image, set "
            "ENV_CONNECT4_IMAGE=<image> in .env") in res.stderr
