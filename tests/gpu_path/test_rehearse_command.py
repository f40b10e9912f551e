"""`make rehearse` end to end: TRAIN_MODE=gpu's layout on CPU, run by the command itself (`python -m tools rehearse`,
what the Makefile runs) with 1 and with 2 trainer processes, on one Compose project.

Real: the generated compose file, the images built by the command, the vLLM CPU twin as the `vllm` service, the
env server health-gated, model-init, the GPU trainer's Dockerfile built on the twin training on CPU through TRL's
VLLMClient and the stack's rollout loop, and weight pushes by reload that change what the twin serves.
The project's `models` volume is seeded with the session's tiny model (what model-init makes, made once per test
session by the same code), so model-init finds it complete, as on a user's second run, instead of spending minutes.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from tests.gpu_path.conftest import TRAINER_STANDIN_IMAGE, ensure_trainer_standin_image
from tests.helpers import EnvFileStack
from trainer.after import first_turn
from contract import sampling_health, stages
from contract.config import CPU_DEFAULT_MODEL

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

PROMPT = [11, 12, 13, 14, 15]
LEARN_STEPS = 20   # as tests/trainer/test_learning.py
SETTINGS = {"ENV_NAME": "echo", "DATASET_SIZE": "16", "SAVE_STEPS": "1000", "SEED": "42", "RESUME": "fresh",
            "LOGGING_STEPS": "1", "VLLM_SERVER_TIMEOUT_S": "600"}


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, tiny_model_dir):
    build = ensure_trainer_standin_image()  # what the command builds first (then from Docker's cache)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    stack = EnvFileStack(tmp_path_factory.mktemp("rehearse"), SETTINGS)
    volume = f"{stack.project}_models"
    docker("volume", "create", "--label", f"com.docker.compose.project={stack.project}",
           "--label", "com.docker.compose.volume=models", volume)
    docker("run", "--rm", "--user", "0", "--entrypoint", "sh", "-v", f"{volume}:/models", "-v",
           f"{tiny_model_dir}:/src:ro", TRAINER_STANDIN_IMAGE,
           "-c", f"cp -r /src {CPU_DEFAULT_MODEL} && chown -R 10001:10001 /models")
    try:
        yield stack
    finally:
        stack.down()


def container(stack: EnvFileStack, service: str) -> str:
    out = docker("ps", "-q", "--filter", f"label=com.docker.compose.project={stack.project}",
                 "--filter", f"label=com.docker.compose.service={service}").stdout.split()
    assert len(out) == 1, (service, out)
    return out[0]


def on_agentnet(stack: EnvFileStack, *cmd: str) -> str:
    """A one-off command in the rehearsal's trainer image beside the twin (the `vllm` name resolves there)."""
    r = docker("run", "--rm", "--network", f"{stack.project}_agentnet", "-v", f"{stack.project}_models:/models:ro",
               TRAINER_STANDIN_IMAGE, *cmd, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


SERVED_LOGPROBS = """
import json, urllib.request
def post(path, body):
    req = urllib.request.Request('http://vllm:8000' + path, json.dumps(body).encode(), {'Content-Type': 'application/json'})
    return json.load(urllib.request.urlopen(req, timeout=300))
model = json.load(urllib.request.urlopen('http://vllm:8000/v1/models', timeout=60))['data'][0]['id']
print(json.dumps(post('/v1/completions', {'model': model, 'prompt': %s, 'max_tokens': 4, 'temperature': 0,
                                         'logprobs': 1})['choices'][0]['logprobs']['token_logprobs']))
""" % PROMPT

BASE_BACK = """
import json, urllib.request
req = urllib.request.Request('http://vllm:8000/collective_rpc', json.dumps({'method': 'reload_weights',
      'kwargs': {'weights_path': '%s'}}).encode(), {'Content-Type': 'application/json'})
urllib.request.urlopen(req, timeout=300)
""" % CPU_DEFAULT_MODEL


def served_logprobs(stack: EnvFileStack) -> list[float]:
    return json.loads(on_agentnet(stack, "python3", "-c", SERVED_LOGPROBS).strip().splitlines()[-1])


def served_base_model_again(stack: EnvFileStack) -> None:
    """Have the twin reload the tiny model's own weights (what it served at start), so each run starts from it."""
    on_agentnet(stack, "python3", "-c", BASE_BACK)


def served_exact_rate(stack: EnvFileStack) -> dict:
    out = on_agentnet(stack, "python3", "-m", "trainer.after.first_turn", "--model", CPU_DEFAULT_MODEL, "--server",
                      "http://vllm:8000")
    return json.loads(out.strip().splitlines()[-1])


def outputs_run(stack: EnvFileStack, *cmd: str) -> str:
    """A one-off command in the rehearsal's trainer image with the project's outputs volume (read-only)."""
    r = docker("run", "--rm", "--network", "none", "-v", f"{stack.project}_outputs:/outputs:ro", TRAINER_STANDIN_IMAGE,
               *cmd, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def step_rows(stack: EnvFileStack, run: str) -> list[dict]:
    text = outputs_run(stack, "cat", f"/outputs/{run}/metrics.jsonl")
    return [json.loads(line) for line in text.splitlines() if '"kind": "step"' in line]


def rehearse(stack: EnvFileStack, **settings: str) -> str:
    res = stack.stack("rehearse", env=settings, timeout=3000)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    return log


def check_server_mode_log(log: str, rollouts: str = "sync") -> None:
    assert "make rehearse: TRAIN_MODE=gpu's services on CPU" in log  # the plan said what it runs
    if rollouts == "async":  # TRL's AsyncGRPOTrainer, its WeightTransferProtocol by reload (trainer.run.async_trainer)
        assert "[train] ROLLOUTS=async: TRL's AsyncGRPOTrainer" in log
        assert "[weight-sync] WEIGHT_TRANSFER=reload (async): no NCCL group" in log  # the one stand-in, said so
        assert "[weight-sync] vLLM reloaded" in log
        return
    assert "generating through the vLLM server at http://vllm:8000" in log  # TRAIN_MODE=gpu's path
    assert "[weight-sync] WEIGHT_TRANSFER=reload: no NCCL group" in log  # the one stand-in, said so
    assert "[weight-sync] vLLM reloaded" in log
    assert re.search(r"fp32 master weights; each push to vLLM is cast to (bfloat16|float16|float32)\n", log), \
        "the push's dtype was not read from the twin's /server_info"


@pytest.mark.parametrize("rollouts", ["sync", "async"])
def test_make_rehearse_one_process_trains_through_the_twin_and_learns(rehearsal, tiny_model_dir, rollouts):
    """Item 7 on the rehearsal, the bar of tests/trainer/test_learning.py, sync and async by ROLLOUTS: greedy exact
    first calls on held-out rows, of the tiny model and of the run's last checkpoint (fp32, transformers: the twin
    serves bf16, where the tiny model's near-tie between answering and calling the tool already tips to the call
    before any training; its figure is printed beside)."""
    run = f"rehearsal-1-{rollouts}"
    log = rehearse(rehearsal, TRAINER_PROCESSES="1", RUN_NAME=run, MAX_STEPS=str(LEARN_STEPS),
                   ROLLOUTS=rollouts)
    check_server_mode_log(log, rollouts)
    init = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={rehearsal.project}",
                  "--filter", "label=com.docker.compose.service=model-init").stdout.split()
    assert init and "already complete; nothing to do" in docker("logs", init[0]).stdout  # it ran, found the seed
    rows = step_rows(rehearsal, run)
    assert [r["step"] for r in rows] == list(range(1, LEARN_STEPS + 1))
    assert sum(r["tools/call_frequency"] for r in rows) > 0
    trained, served = served_logprobs(rehearsal), served_exact_rate(rehearsal)
    served_base_model_again(rehearsal)
    assert served_logprobs(rehearsal) != trained, "the pushes never changed what the twin serves"
    served_before = served_exact_rate(rehearsal)
    before = first_turn.evaluate(str(tiny_model_dir))
    after = json.loads(outputs_run(rehearsal, "python3", "-m", "trainer.after.first_turn", "--model",
                                   f"/outputs/{run}/checkpoint-{LEARN_STEPS}").strip().splitlines()[-1])
    print(f"[{run}] greedy exact first calls on {after['prompts']} held-out rows: {before['exact_rate']:.2f} "
          f"before, {after['exact_rate']:.2f} after {LEARN_STEPS} steps; served by the twin (bf16): "
          f"{served_before['exact_rate']:.2f} before, {served['exact_rate']:.2f} after {LEARN_STEPS - 1} pushes")
    assert before["exact_rate"] <= 0.2, before
    assert after["exact_rate"] >= 0.8, (before, after)
    assert after["exact_rate"] >= before["exact_rate"] + 0.6


def test_make_rehearse_two_processes_pushes_into_the_twin_and_judges_importance_sampling(rehearsal):
    """What the docker-run rehearsal asserted, now through the command: 2 ranks (gloo), milestones, metrics, and a
    push that changes the served model."""
    before = served_logprobs(rehearsal)
    # groups of 8: a group whose rewards all tie moves no weight, and 4 such groups in a row are rare
    log = rehearse(rehearsal, TRAINER_PROCESSES="2", RUN_NAME="rehearsal-2", MAX_STEPS="3", LEARNING_RATE="1e-3",
                   NUM_GENERATIONS="8", PER_DEVICE_TRAIN_BATCH_SIZE="16")
    check_server_mode_log(log)
    assert "[launch] 2 trainer processes (ddp, gloo)" in log
    rows = step_rows(rehearsal, "rehearsal-2")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r["tools/call_frequency"] for r in rows) > 0
    assert any(r["grad_norm"] > 0 for r in rows[:2]), [(r["reward_std"], r["grad_norm"]) for r in rows]
    assert served_logprobs(rehearsal) != before, "the served model did not change after the trainer's weight push"
    print("[rehearsal 2] " + "; ".join(f"step {r['step']}: {sampling_health.describe(r)}" for r in rows))
    assert all(sampling_health.MASKED_FRACTION in r and sampling_health.has_figures(r) for r in rows), rows[-1]
    ok, detail = sampling_health.verdict(rows)
    assert ok is True, detail
    assert stages.parse(log)["importance_sampling"]["ok"] is True

