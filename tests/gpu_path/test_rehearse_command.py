"""`make rehearse` end to end: TRAIN_MODE=gpu's layout on CPU, run by the command itself (`python -m tools rehearse`,
what the Makefile runs) with 1 and with 2 trainer processes, on one Compose project. The twin dying mid-run and the
run resuming once make rehearse has restarted it: tests/reliability/test_chaos.py (async, the twin SIGKILLed); the
sync trainer's stop for a vLLM gone (exit 77) and make train's one restart: tests/gpu_path/test_vllm_recovery.py.

Real: the generated compose file, the images built by the command, the vLLM CPU twin as the `vllm` service, the
env server health-gated, model-init, the GPU trainer's Dockerfile built on the twin training on CPU through TRL's
VLLMClient and the stack's rollout loop, and weight pushes by reload that change what the twin serves.
The project's `models` volume is seeded with the session's tiny model (what model-init makes, made once per test
session by the same code), so model-init finds it complete, as on a user's second run, instead of spending minutes.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess

import pytest

from tests.gpu_path.conftest import TRAINER_STANDIN_IMAGE, ensure_trainer_standin_image
from tests.helpers import LEARN_SEEDS, EnvFileStack, seed_models_volume
from trainer.after import first_turn
from contract import sampling_health, stages
from contract.config import CPU_DEFAULT_MODEL

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(3600)]

PROMPT = [11, 12, 13, 14, 15]
# Optimizer steps of each mode's learning run, and what else it sets. Sync: 2 trainer processes (DDP over gloo) of 16
# samples each, 32 a step (8 groups of 4), the twin generating them in one batch: 6 steps took 11-27 s (20 steps of 8
# took ~100 s of CI's time and once ended at 0.62). Async: 1 process; TRL packs a step up to the token budget (VLLM_MAX_MODEL_LEN below),
# dozens of samples. Every run measured was at 1.00 after these steps (the spread in the test's docstring).
LEARN_STEPS = {"sync": 6, "async": 4}
LEARN_SETTINGS = {"sync": {"TRAINER_PROCESSES": "2", "PER_DEVICE_TRAIN_BATCH_SIZE": "16"},
                  # #66: the async run evaluates too (4 held-out echo episodes at steps 2 and 4, greedy, on the twin)
                  "async": {"TRAINER_PROCESSES": "1", "EVAL_EVERY": "2", "EVAL_EPISODES": "4"}}
# Greedy exact first calls after LEARN_STEPS, of the run's last checkpoint: the bar each mode must reach. The twin's
# sampling is not seeded (TRL's server client sends no per-request seed), so runs of one seed differ; the spreads
# measured are in the test's docstring, and each bar leaves the worst of them a margin.
LEARN_BAR = {"sync": 0.8, "async": 0.8}
# VLLM_MAX_MODEL_LEN: the longest echo episode is ~410 tokens (preflight prints it); ROLLOUTS=async packs each step
# up to the server's max_model_len in tokens (TRL's token_budget), ~500 samples a step at the default 4096, ~8x
# fewer at 512 (the async learning run took 348 s at 4096 on a 2-core machine; 4 steps take 20-45 s at 512)
SETTINGS = {"ENV_NAME": "echo", "DATASET_SIZE": "16", "SAVE_STEPS": "1000", "SEED": "42", "RESUME": "fresh",
            "LOGGING_STEPS": "1", "VLLM_SERVER_TIMEOUT_S": "600", "VLLM_MAX_MODEL_LEN": "512"}


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, tiny_model_dir):
    build = ensure_trainer_standin_image()  # what the command builds first (then from Docker's cache)
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    stack = EnvFileStack(tmp_path_factory.mktemp("rehearse"), SETTINGS)
    seed_models_volume(stack.project, tiny_model_dir, TRAINER_STANDIN_IMAGE)
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


@functools.lru_cache(maxsize=1)
def base_model_exact_rate(model_dir: str) -> dict:
    """The tiny model's greedy exact first calls: the same for every learning run of the session."""
    return first_turn.evaluate(model_dir)


def served_logprobs(stack: EnvFileStack) -> list[float]:
    return json.loads(on_agentnet(stack, "python3", "-c", SERVED_LOGPROBS).strip().splitlines()[-1])


def served_base_model_again(stack: EnvFileStack) -> None:
    """Have the twin reload the tiny model's own weights (what it served at start), so each run starts from it."""
    on_agentnet(stack, "python3", "-c", BASE_BACK)


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


def check_server_mode_log(log: str, rollouts: str = "sync", steps: int = 0) -> None:
    assert "make rehearse: TRAIN_MODE=gpu's services on CPU" in log  # the plan said what it runs
    if rollouts == "async":  # TRL's AsyncGRPOTrainer, its WeightTransferProtocol by reload (trainer.async_grpo.async_trainer)
        assert "[train] ROLLOUTS=async: TRL's AsyncGRPOTrainer" in log
        assert "tree attention backend sdpa" in log  # the portable tree attention, no Hub kernel fetch
        assert "[weight-sync] WEIGHT_TRANSFER=reload (async): no NCCL group" in log  # the one stand-in, said so
        if steps:  # TRL's cold sync at train begin, then one after each optimizer step
            assert log.count("[weight-sync] vLLM reloaded") == steps + 1, log[-6000:]
        return
    assert "generating through the vLLM server at http://vllm:8000" in log  # TRAIN_MODE=gpu's path
    assert "[weight-sync] WEIGHT_TRANSFER=reload: no NCCL group" in log  # the one stand-in, said so
    assert "[weight-sync] vLLM reloaded" in log
    assert re.search(r"fp32 master weights; each push to vLLM is cast to (bfloat16|float16|float32)\n", log), \
        "the push's dtype was not read from the twin's /server_info"


@pytest.mark.parametrize("seed", LEARN_SEEDS)
@pytest.mark.parametrize("rollouts", ["sync", "async"])
def test_make_rehearse_trains_through_the_twin_and_learns(rehearsal, tiny_model_dir, rollouts, seed):
    """Item 7 on the rehearsal, the bar of tests/trainer/test_learning.py, sync and async by ROLLOUTS: greedy exact
    first calls on held-out rows, of the tiny model and of the run's last checkpoint (fp32, transformers: the twin
    serves bf16, where the tiny model's near-tie between answering and calling the tool can tip either way; that the
    pushes changed what the twin serves is asserted by its log-probs). Sync runs 2 trainer processes (gloo): both
    ranks in every step, the milestones, and the importance-sampling verdict on the twin's log-probs.

    Spread, sync, 2 processes (2026-12-06, this 2-core machine with a clean-clone CI run beside it): after 5 steps
    seeds 1, 2, 4, 5 at 1.00 and seed 3 at 0.80 (no margin), so it runs 6: seeds 3, 6, 7, 8 at 1.00, 0.00 before each
    (a margin of 0.2). (1 process, 5 steps of 32: 1.00 for each of seeds 1-5, 2026-12-05; before, 20 steps of 8: 1.00
    for each seed on 2026-12-04, but 0.62 in one CI run.) Async, from checkpoints of longer runs (2026-12-04, the same
    machine, a helper's tests beside it): seeds 1, 2, 3 at 1.00 after steps 4, 8 and 12; seeds 42, 4, 5, 6 at 1.00
    after steps 2, 4 and 6 (VLLM_MAX_MODEL_LEN 1024). At 512, half the samples a step (2026-12-05,
    LEARN_SEEDS=1,2,3,4,5, a helper's CPU benchmark beside it): 1.00 after 4 steps for every seed, 0.00 before each.
    It runs 4 steps (20 before: 270 s of CI's time) and never measured below 1.00 (a margin of 0.2 over its bar)."""
    run, steps = f"rehearsal-{rollouts}-{seed}", LEARN_STEPS[rollouts]
    log = rehearse(rehearsal, RUN_NAME=run, MAX_STEPS=str(steps), ROLLOUTS=rollouts, SEED=str(seed),
                   **LEARN_SETTINGS[rollouts])
    check_server_mode_log(log, rollouts, steps)
    init = docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={rehearsal.project}",
                  "--filter", "label=com.docker.compose.service=model-init").stdout.split()
    assert init and "already complete; nothing to do" in docker("logs", init[0]).stdout  # it ran, found the seed
    rows = step_rows(rehearsal, run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert sum(r["tools/call_frequency"] for r in rows) > 0
    if rollouts == "async":  # EVAL_EVERY with ROLLOUTS=async (trainer.async_grpo.async_eval): played on the twin
        evaluated = [r for r in rows if "eval/echo/episodes" in r]
        assert [r["step"] for r in evaluated] == [2, 4], rows[-1]
        assert all(r["eval/echo/episodes"] == 4 and r["eval/echo/infra_failures"] == 0 for r in evaluated), evaluated
        assert re.search(r"eval at step 4: echo reward \d\.\d{3} .*\(ROLLOUTS=async: the vLLM server's policy", log)
        print(f"[{run}] eval reward at steps 2, 4: {[r['eval/echo/reward_mean'] for r in evaluated]}, "
              f"{[round(r['time/eval_s'], 1) for r in evaluated]} s each")
    if rollouts == "sync":
        assert "[launch] 2 trainer processes (ddp, gloo)" in log
        print(f"[{run}] " + "; ".join(f"step {r['step']}: {sampling_health.describe(r)}" for r in rows))
        assert all(sampling_health.MASKED_FRACTION in r and sampling_health.has_figures(r) for r in rows), rows[-1]
        ok, detail = sampling_health.verdict(rows)
        assert ok is True, detail
        assert stages.parse(log)["importance_sampling"]["ok"] is True
    trained = served_logprobs(rehearsal)
    served_base_model_again(rehearsal)
    assert served_logprobs(rehearsal) != trained, "the pushes never changed what the twin serves"
    before = base_model_exact_rate(str(tiny_model_dir))
    after = json.loads(outputs_run(rehearsal, "python3", "-m", "trainer.after.first_turn", "--model",
                                   f"/outputs/{run}/checkpoint-{steps}").strip().splitlines()[-1])
    print(f"[{run}] greedy exact first calls on {after['prompts']} held-out rows: {before['exact_rate']:.2f} "
          f"before, {after['exact_rate']:.2f} after {steps} steps ({sum(r['time/step_s'] for r in rows):.0f} s of "
          f"steps)")
    assert before["exact_rate"] <= 0.2, before
    assert after["exact_rate"] >= LEARN_BAR[rollouts], (before, after)
    assert after["exact_rate"] >= before["exact_rate"] + LEARN_BAR[rollouts] - 0.2


SERVED = """
import json, sys, urllib.request
def post(path, body):
    req = urllib.request.Request('http://vllm:8000' + path, json.dumps(body).encode(), {'Content-Type': 'application/json'})
    return json.load(urllib.request.urlopen(req, timeout=300))
models = json.load(urllib.request.urlopen('http://vllm:8000/v1/models', timeout=60))['data']
out = {'models': {m['id']: m.get('root') for m in models}}
for m in models:
    out[m['id']] = post('/v1/completions', {'model': m['id'], 'prompt': %s, 'max_tokens': 4, 'temperature': 0,
                                            'logprobs': 1})['choices'][0]['logprobs']['token_logprobs']
print(json.dumps(out))
""" % PROMPT

SAME_ADAPTER = """
import sys
from safetensors.torch import load_file
pushed, saved = (load_file(f'{d}/adapter_model.safetensors') for d in sys.argv[1:3])
assert pushed.keys() == saved.keys() and len(pushed) > 0, (sorted(pushed)[:3], sorted(saved)[:3])
assert all((pushed[k] == saved[k]).all() for k in pushed), 'the pushed adapter is not the checkpoint one'
assert any(t.abs().sum() > 0 for k, t in pushed.items() if 'lora_B' in k), 'lora_B still zero: nothing trained'
print(len(pushed), 'adapter tensors, pushed == checkpoint')
"""


def test_make_rehearse_async_lora_pushes_the_adapter_alone_and_the_twin_serves_what_the_trainer_wrote(rehearsal):
    """#32: ROLLOUTS=async with LORA_R=8 through `make rehearse`: the plan restarts the twin with the vllm service's
    LoRA flags (trainer/modeling/lora.py), TRL's adapter-only sync writes <run>/.vllm_lora/trl-policy-v<N> and has the twin
    load it by /v1/load_lora_adapter (no weight reload, no NCCL), the worker's requests name it, and after the run
    the newest served adapter is the run's last checkpoint, byte for byte, and serves other log-probs than the base.
    With 2 trainer processes (TRAINER_SHARDING=fsdp, as ROLLOUTS=async asks; on CPU accelerate runs them as DDP over
    gloo, keeping FSDP for GPU backends: the sharded gather is test_master_weights.py's FSDP2 test) both ranks take
    part in every sync and rank 0 writes it. The run then resumes for a 4th step from the adapter-only checkpoint
    and TRL's rollout state, unloading first the adapters the first run left in the twin. (One process: the same
    path without the collective, test_lora.py's and the async learning run's.) Last in this module: the twin keeps
    the LoRA flags after it."""
    run = "rehearsal-lora-async"
    # MAX_STALENESS=2: versions v2..v4 stay loaded (--max-loras=4); groups of 8 so a step moves the adapter;
    # ASYNC_STEP_SAMPLES=batch: 8 samples a step per process (packed: dozens), the adapter's path is the subject here
    settings = dict(TRAINER_PROCESSES="2", TRAINER_SHARDING="fsdp", RUN_NAME=run, ROLLOUTS="async", LORA_R="8",
                    MAX_STALENESS="2", LEARNING_RATE="2e-3", NUM_GENERATIONS="8", PER_DEVICE_TRAIN_BATCH_SIZE="8",
                    ASYNC_STEP_SAMPLES="batch")
    log = rehearse(rehearsal, **settings, MAX_STEPS="3")
    assert "[launch] 2 trainer processes (fsdp, gloo)" in log, log[-6000:]
    assert "[train] ROLLOUTS=async: TRL's AsyncGRPOTrainer" in log
    assert "training: LoRA r=8" in log
    assert "[weight-sync] LoRA adapter-only (async): no NCCL group, no base weight pushed" in log, log[-6000:]
    assert "[weight-sync] vLLM reloaded" not in log and "WEIGHT_TRANSFER=reload (async)" not in log
    twin_args = docker("inspect", "--format", "{{json .Args}}", container(rehearsal, "vllm")).stdout
    assert all(flag in twin_args for flag in ("--enable-lora", "--max-lora-rank=8", "--max-loras=4")), twin_args
    rows = step_rows(rehearsal, run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r["tools/call_frequency"] for r in rows) > 0  # the worker's requests, by adapter name, were served
    print("[rehearsal lora async] weight sync s per step: " + ", ".join(
        f"{r.get('perf/weight_sync_s', float('nan')):.3f}" for r in rows))

    served = json.loads(on_agentnet(rehearsal, "python3", "-c", SERVED).strip().splitlines()[-1])
    adapters = {name: root for name, root in served["models"].items() if name.startswith("trl-policy-v")}
    newest = max(adapters, key=lambda name: int(name.rsplit("v", 1)[1]))
    # TRL's cold sync before step 1 is v1, then one per step; v1 was unloaded past MAX_STALENESS
    assert sorted(adapters) == ["trl-policy-v2", "trl-policy-v3", "trl-policy-v4"], served["models"]
    assert adapters[newest] == f"/outputs/{run}/.vllm_lora/{newest}"  # the folder the trainer wrote, read-only
    (base_name,) = set(served["models"]) - set(adapters)  # the tiny model the twin serves
    base = served[base_name]
    print(f"[rehearsal lora async] base {base}\n{newest} {served[newest]}")
    assert served[newest] != base, "the pushed adapter did not change what the twin serves"
    print(outputs_run(rehearsal, "python3", "-c", SAME_ADAPTER, adapters[newest], f"/outputs/{run}/checkpoint-3"))

    # resume (#32 item 5): one step more from the adapter-only checkpoint and TRL's rollout state, both ranks again;
    # the twin then serves the resumed run's newest adapter, which is its new last checkpoint
    log = rehearse(rehearsal, **settings, MAX_STEPS="4", RESUME="auto")
    assert f"resuming from /outputs/{run}/checkpoint-3" in log, log[-6000:]
    assert "[weight-sync] unloaded 3 adapter(s) an earlier run left in vLLM" in log, log[-6000:]
    assert [r["step"] for r in step_rows(rehearsal, run)] == [1, 2, 3, 4]
    served = json.loads(on_agentnet(rehearsal, "python3", "-c", SERVED).strip().splitlines()[-1])
    resumed = max((name for name in served["models"] if name.startswith("trl-policy-v")),
                  key=lambda name: int(name.rsplit("v", 1)[1]))
    assert int(resumed.rsplit("v", 1)[1]) > int(newest.rsplit("v", 1)[1]), (newest, served["models"])
    print(outputs_run(rehearsal, "python3", "-c", SAME_ADAPTER, f"/outputs/{run}/.vllm_lora/{resumed}",
                      f"/outputs/{run}/checkpoint-4"))
