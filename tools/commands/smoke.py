"""`make gpu-smoke`: 3 training steps, then pass/FAIL with timings for every stage a first run goes through
(`--gpu` refuses to stand in the CPU profile for the GPU path)."""

from __future__ import annotations

import subprocess
import time

from tools import docker_host, settings
from tools.errors import StackError, say
from contract import sampling_health
from contract.config import Rollouts, SyncRollouts, TrainModeVariant, rollouts_variant
from tools.commands.up import bring_up
from tools.prepare import Prepared, prepare

SMOKE_STEPS = 3
# (stage, what it proves, what a failure usually means); docs/gpu-host.md "First run on a GPU host" has the same list.
SMOKE_STAGES = {
    "model_download": ("model download", "MODEL_NAME at MODEL_REVISION fetched, chat template checked",
                       "MODEL_NAME / MODEL_REVISION / HF token (a gated model), or the chat template TRL cannot train"),
    "vllm_healthy": ("vLLM healthy", "the vllm service serves the model with dev mode + NCCL weight transfer",
                     "`make logs`: out of GPU memory (VLLM_GPU_MEMORY_UTILIZATION, VLLM_MAX_MODEL_LEN), driver"),
    "rendezvous": ("rendezvous", "trainer (rank 0) and the vLLM workers formed the NCCL group",
                   "network between the containers, VLLM_HOST_IP, NCCL_SOCKET_IFNAME; run `make nccl-check`"),
    "first_generation": ("first generation", "rollouts generated, tool calls sent to the env servers",
                         "env servers (capacity, health) or generation; the trainer log says which"),
    "first_optimizer_step": ("first optimizer step", "loss, backward and AdamW step on the trainer's device",
                             "trainer GPU memory (PER_DEVICE_TRAIN_BATCH_SIZE, MAX_COMPLETION_LENGTH)"),
    "first_weight_sync": ("first weight sync", "new weights pushed into vLLM (seconds)",
                          "NCCL transport; `make nccl-check FULL=1` repeats it with timings"),
    "importance_sampling": ("importance sampling", "vLLM's and the trainer's log-probs agree at steps "
                            f"{'-'.join(map(str, sampling_health.JUDGED_STEPS))} (mean ratio in "
                            f"[{sampling_health.RATIO_BOUNDS[0]}, {sampling_health.RATIO_BOUNDS[1]}], at most "
                            f"{sampling_health.MAX_MASKED:.0%} of sequences masked and of tokens clipped by "
                            "OFF_POLICY_CORRECTION, no loss weight over its cap; both ROLLOUTS alike)",
                            "a garbled weight sync or numeric drift (masked sequences do not train): `make nccl-check "
                            "FULL=1`, the trainer's weight dtype, the model revision vLLM serves"),
    "staleness": ("staleness (async)", "ROLLOUTS=async: samples trained within MAX_STALENESS policy versions, at "
                  f"most {sampling_health.MAX_DROPPED_SHARE:.0%} dropped as stale",
                  "generation runs too far ahead of training: lower MAX_INFLIGHT_ROLLOUTS (e.g. to one step's samples), "
                  "or raise MAX_STALENESS"),
    "tool_calls": ("tool calls per episode", "the model calls the env's tools (> 0)",
                   "0: the model never calls a tool (chat template, ENABLE_THINKING, MAX_COMPLETION_LENGTH)"),
}


def smoke_stages(mode: TrainModeVariant, rollouts: Rollouts = SyncRollouts()) -> tuple[str, ...]:
    """The mode's stages; ROLLOUTS=async adds `staleness` after the first weight sync (the importance-sampling stage
    judges both modes on the same off_policy/* figures: contract.sampling_health.OFF_POLICY_RATIO)."""
    found = mode.spec.smoke_stages
    if not rollouts.is_async or "first_weight_sync" not in found:
        return found
    at = found.index("first_weight_sync") + 1
    return (*found[:at], "staleness", *found[at:])


def smoke_table(mode: TrainModeVariant, found: dict[str, dict], failed_rc: int | None,
                rollouts: Rollouts = SyncRollouts()) -> tuple[list[str], bool]:
    """The smoke run's verdict, one line per stage: pass with its time, or FAIL with what it usually means."""
    lines, ok = [], True
    for key in smoke_stages(mode, rollouts):
        title, proves, meaning = SMOKE_STAGES[key]
        record = found.get(key)
        passed = record is not None and (key != "tool_calls" or (record.get("value") or 0) > 0) \
            and (key not in ("importance_sampling", "staleness") or record.get("ok") is True)  # sampling_health
        if passed:
            took = f" {record['seconds']:.1f}s" if record.get("seconds") is not None else ""
            detail = record.get("detail") or proves
            lines.append(f"  pass {title:<24}{took:>9}  {detail}")
        else:
            ok = False
            why = "never reached" if record is None else (record.get("detail") or "failed")
            lines.append(f"  FAIL {title:<24}{'':>9}  {why}: {meaning}")
    if failed_rc not in (None, 0):
        ok = False
        lines.append(f"  FAIL {'trainer exit':<24}{'':>9}  exit code {failed_rc}: the trainer log above says why")
    return lines, ok


def scheduler_line(found: dict[str, dict], values: dict[str, str]) -> str:
    """Which scheduler vLLM ran: the trainer's `vllm_scheduler` stage (read from the server), else the flag state
    VLLM_EXTRA_ARGS started it with (docs/gpu-host.md: `--no-async-scheduling` first if async pushes misbehave)."""
    from contract import vllm_flags

    record = found.get("vllm_scheduler")
    if record:
        return f"  info {'vLLM scheduler':<24}{'':>9}  {record.get('detail')}"
    try:
        words = vllm_flags.parse(values.get("VLLM_EXTRA_ARGS"))
    except ValueError:
        words = []
    detail = vllm_flags.scheduler_detail(None, "the trainer never reached vLLM", words)
    return f"  info {'vLLM scheduler':<24}{'':>9}  {detail}"


def run_logged(cmd: list[str], dotenv: dict[str, str]) -> tuple[int, str]:
    """Run, echo every line as it comes, and keep the text for the stage records."""
    proc = subprocess.Popen(cmd, cwd=settings.ROOT, env=dotenv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        seen.append(line)
    return proc.wait(), "".join(seen)


def smoke(prepared: Prepared, require_gpu: bool) -> int:
    """`make gpu-smoke`: 3 training steps, then pass/FAIL with timings for every stage a first run goes
    through. `--gpu` refuses to stand in the CPU profile for the GPU path."""
    from contract import stages

    mode, compose_vars = prepared.mode, prepared.compose_vars
    rollouts = rollouts_variant(prepared.plan.settings.values.get("ROLLOUTS") or "sync")
    if require_gpu and not mode.uses_vllm:
        raise StackError(f"make gpu-smoke checks the GPU path, and this host has {docker_host.detect_gpus().detail}; "
                         "`make doctor` says why, `make train` trains on the CPU profile here")
    log_text, t0 = "", time.monotonic()
    if mode.uses_vllm:
        say("stage: model download (model-download job)")
        rc, text = run_logged(docker_host.compose_command(compose_vars, "run", "--rm", "-T", "model-download")[0], compose_vars)
        log_text += text
        if rc != 0:
            lines, _ = smoke_table(mode, stages.parse(log_text), rc, rollouts)
            print("\n".join(["[stack] gpu-smoke: model download failed", *lines]))
            return rc
    bring_up(prepared)
    service = prepared.plan.spec.trainer_service
    if prepared.plan.spec.makes_model_locally:
        rc, text = run_logged(docker_host.compose_command(compose_vars, "run", "--rm", "-T", "model-init")[0], compose_vars)
        if rc != 0:
            say(f"the CPU profile's model-init job failed (exit {rc}); the messages above say why")
            return rc
    args = [*docker_host.TRAINER_PYTHON, "-m", "trainer.launch", "--max-steps", str(SMOKE_STEPS), "--run-name", f"smoke-{mode}",
            "--resume", "fresh", "--logging-steps", "1"]  # every step's metrics: the importance-sampling stage reads 2-3
    say(f"stage: {SMOKE_STEPS} training steps with `{service}` (mode {mode}, ROLLOUTS={rollouts}), "
              f"run smoke-{mode}")
    rc, text = run_logged(docker_host.compose_command(compose_vars, "run", "--rm", "-T", "--no-deps", service, *args)[0], compose_vars)
    found = stages.parse(log_text + text)
    lines, ok = smoke_table(mode, found, rc, rollouts)
    print(f"[stack] smoke run, mode {mode}, {time.monotonic() - t0:.0f}s in all:")
    print("\n".join(lines))
    print(scheduler_line(found, prepared.plan.settings.values))
    print("[stack] smoke: " + ("PASSED: a real run will go through the same stages" if ok else
                               "FAILED: see the first FAIL line and docs/gpu-host.md 'First run on a GPU host'"))
    return 0 if ok else 1


def run(rest: list[str]) -> int:
    return smoke(prepare(), require_gpu="--gpu" in rest)
