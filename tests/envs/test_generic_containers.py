"""Any OpenEnv image, trained by naming it in `.env` (no file of the repo edited), on real containers.

The fixture envs (tests/fixtures/envs) are built as images, as a user's OpenEnv images would be, and
driven only through an env file and `python -m tools train` (what `make train` runs):
  * notebook (MCP tools) + guess (typed action, ONE session per container) in one CPU run: the trainer
    learns both interfaces from the servers, the tiny model is warm-started on their tools, tool
    calls and per-env rewards land in metrics.jsonl; a judge added by two more lines (JUDGE_URL: a stand-in judge
    on the stack's agentnet, tests/trainer/judge_double.py, that answers 9 and fails every other call) scores
    both envs' episodes, its failed calls left out of the reward;
  * guess (one session per container) needs no replica count: ENV_GUESS_REPLICAS=auto, the default, measures
    one container and runs as many as the run opens sessions;
  * guess with too few replicas set by hand: preflight probes its capacity and says which variable to raise;
  * an image that is no OpenEnv server: one line naming the image.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.helpers import ROOT, TRAINER_CPU_IMAGE, EnvFileStack, build_images

pytestmark = [pytest.mark.docker, pytest.mark.slow]

FIXTURES = ROOT / "tests" / "fixtures" / "envs"
RUN = "zero-code"


def fixture_image(name: str) -> str:
    tag = f"grpo-fixture/{name}:local"
    subprocess.run(["docker", "build", "-q", "-f", str(FIXTURES / "Dockerfile"), "-t", tag, str(FIXTURES / name)],
                   check=True, capture_output=True)
    return tag


@pytest.fixture(scope="module")
def images(docker):
    build_images("env-server", "trainer-cpu")
    return {name: fixture_image(name) for name in ("notebook", "guess", "not_openenv")}


JUDGE = "judge-standin"  # the stand-in judge's name on the project's agentnet, where the trainers reach a judge


def start_stand_in_judge(project: str) -> str:
    """tests/trainer/judge_double.py served in a container on `project`'s agentnet (made here with Compose's labels, so
    the stack takes it as its own), as a JUDGE_URL endpoint elsewhere would be; returns once it answers."""
    network, name = f"{project}_agentnet", f"{project}-{JUDGE}"
    subprocess.run(["docker", "network", "create", "--label", f"com.docker.compose.project={project}",
                    "--label", "com.docker.compose.network=agentnet", network], check=True, capture_output=True)
    subprocess.run(["docker", "run", "-d", "--name", name, "--network", network, "--network-alias", JUDGE,
                    "-v", f"{ROOT / 'tests' / 'trainer' / 'judge_double.py'}:/judge/judge_double.py:ro",
                    "--entrypoint", "python3", TRAINER_CPU_IMAGE, "/judge/judge_double.py", "--port", "8000"],
                   check=True, capture_output=True)
    while "stand-in judge ready" not in (logs := subprocess.run(["docker", "logs", name], capture_output=True,
                                                                  text=True)).stdout:
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name], capture_output=True, text=True)
        assert state.stdout.strip() == "true", logs.stdout + logs.stderr  # exited: say why, do not wait
        time.sleep(0.2)
    return name


@pytest.fixture(scope="module")
def trained(images, tmp_path_factory):
    """One CPU run on notebook + guess, named only in the env file, judged by a stand-in judge at JUDGE_URL."""
    stack = EnvFileStack(tmp_path_factory.mktemp("zero-code"), {
        "TRAIN_MODE": "cpu", "ENV_NAME": "notebook,guess", "RUN_NAME": RUN, "MAX_STEPS": "3",
        "ENV_NOTEBOOK_IMAGE": images["notebook"], "ENV_GUESS_IMAGE": images["guess"],  # no ENV_*_REPLICAS: auto
        # 4 rollouts per generation batch: at worst all 4 on guess, 1 per replica
        "PER_DEVICE_TRAIN_BATCH_SIZE": "4", "NUM_GENERATIONS": "2",
        # the judge, two lines (the cache off: the tiny policy repeats itself, and a repeat would be no call)
        "JUDGE_URL": f"http://{JUDGE}:8000/v1", "JUDGE_CACHE_SIZE": "0",
    })
    judge = None
    try:
        judge = start_stand_in_judge(stack.project)
        res = stack.stack("train")
        yield stack, res
    finally:
        if judge:  # off the network first, or the project's `down` cannot remove it
            subprocess.run(["docker", "rm", "-f", judge], capture_output=True)
        stack.down()


def test_two_envs_named_only_in_the_env_file_train_with_tool_calls_and_rewards(trained):
    stack, res = trained
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
    # the judge scored both envs' episodes; its failed calls (every other one) are left out, not scored 0
    assert "judge at JUDGE_URL http://judge-standin:8000/v1" in out, out[-8000:]
    assert all(r["judge/calls"] > 0 and r["judge/failures"] > 0 and r["rewards/judge/mean"] == 1.0 for r in steps), \
        [{k: v for k, v in r.items() if k.startswith(("judge/", "rewards/judge"))} for r in steps]
    print(f"zero-code run: tool calls/episode {[round(r['tools/call_frequency'], 2) for r in steps]}, "
          f"reward {[round(r['reward'], 3) for r in steps]}, judge calls {[r['judge/calls'] for r in steps]} "
          f"({[r['judge/failures'] for r in steps]} failed, left out)")


def test_too_few_replicas_of_a_one_session_image_stop_preflight_with_the_variable_to_raise(trained):
    stack, _ = trained
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
