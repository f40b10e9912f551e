"""Train: bring the stack up, then run the trainer (the CPU profile with a tiny local model when no NVIDIA GPU).
Extra arguments go to `trainer.launch` (e.g. --max-steps 3)."""

from __future__ import annotations

from typing import Callable

from tools import docker_host, env_keys, judge
from tools.errors import say
from contract.defaults import EXIT_JUDGE_DOWN, EXIT_VLLM_RESTART, EXIT_VLLM_WENT_AWAY
from tools.commands.up import bring_up
from tools.prepare import Prepared, prepare


def train(prepared: Prepared, args: list[str]) -> int:
    for line in env_keys.unread_keys(prepared.plan.values):  # a misspelled setting would silently keep its default
        say(f"WARNING: {line}")
    spec, mode = prepared.plan.spec, prepared.mode
    # the CPU profile's judge once model-init has run in the foreground (it may serve model-init's tiny model)
    held = (judge.SERVICE,) if spec.makes_model_locally and prepared.plan.judge_served else ()
    bring_up(prepared, hold=held)
    deps: list[str] = []
    if spec.makes_model_locally:  # the init job in the foreground, so its messages (e.g. an env's bad schema) are seen
        rc = prepared.compose("run", "--rm", "model-init")
        if rc != 0:
            say(f"the CPU profile's model-init job failed (exit {rc}); the messages above say why")
            return rc
        deps = ["--no-deps"]  # env servers are up and healthy (above), the model is made
    if held:
        say("starting the judge (the vLLM CPU twin) and waiting until healthy")
        rc = prepared.compose("up", "-d", "--wait", *held)
        if rc != 0:
            say(f"the judge did not become healthy (exit {rc}): `make logs` shows why; `make doctor` checks its settings")
            return rc
    say(f"training with `{spec.trainer_service}` (mode {mode}); outputs go to the `outputs` volume")

    def run_trainer(extra: tuple[str, ...] = ()) -> int:
        argv = [*args, *extra]  # the image's command is trainer.launch; arguments are given to it only when there are some
        return prepared.compose("run", "--rm", *deps, spec.trainer_service,
                                *([*docker_host.TRAINER_PYTHON, "-m", "trainer.launch", *argv] if argv else []))

    def restart_vllm() -> int:  # a fresh container, not the wedged one restarted; `--wait`: until healthy
        return prepared.compose("up", "-d", "--no-deps", "--force-recreate", "--wait", "vllm")

    def restart_judge() -> int:  # the stack's judge, as vLLM: a fresh container, health-gated
        return prepared.compose("up", "-d", "--no-deps", "--force-recreate", "--wait", judge.SERVICE)

    serves_judge = prepared.plan.judge_served
    rc = (recovering(run_trainer, restart_vllm if spec.runs_vllm_service else None,
                     restart_judge if serves_judge else None)
          if spec.runs_vllm_service or serves_judge else run_trainer())
    where = ("the CPU profile (tiny local model, no vLLM)" if not mode.uses_vllm else
             f"mode {mode}'s rehearsal on CPU" if prepared.plan.rehearsal else f"mode {mode}")
    if rc == 0:
        say(f"training finished on {where}; `make rollouts` shows what the model did, `make eval` scores it, "
                  "`make report` plots it")
    else:
        say(f"training on {where} stopped with exit code {rc}; the messages above say why. "
                  "`make train` again resumes from the last checkpoint")
    return rc


def recovering(run_trainer: Callable[..., int], restart_vllm: Callable[[], int] | None,
               restart_judge: Callable[[], int] | None = None) -> int:
    """Run the trainer; when it exits with EXIT_VLLM_RESTART (the last run left a weight push unfinished, or vLLM
    gives no one-token answer: trainer.gpu.push_state) or EXIT_VLLM_WENT_AWAY (vLLM died or restarted mid-run:
    trainer.gpu.server.went_away), restart the vllm service, health-gated, and run it once more, resuming from the
    run's last checkpoint after a mid-run loss (`--resume auto`, the last argument, wins over RESUME=fresh). Once: a
    vLLM that a fresh start does not cure is a failure to read, not to loop on. EXIT_JUDGE_DOWN (the stack's judge
    failed every call for JUDGE_DOWN_AFTER_S: trainer.judge.costs) restarts the judge service the same way, then
    resumes; a judge elsewhere (JUDGE_URL) is not ours to restart: the exit stands."""
    rc = run_trainer()
    if rc == EXIT_JUDGE_DOWN and restart_judge is not None:  # the stack's judge stayed down (trainer.judge.costs)
        say("restarting the judge service (the trainer's line above says why), health-gated, then training again")
        restarted = restart_judge()
        if restarted != 0:
            say(f"restarting the judge failed (exit {restarted}); `docker compose logs judge` says why")
            return restarted
        return run_trainer(("--resume", "auto"))
    if rc not in (EXIT_VLLM_RESTART, EXIT_VLLM_WENT_AWAY) or restart_vllm is None:
        return rc
    say("restarting the vllm service (the trainer's line above says why), health-gated, then training again")
    restarted = restart_vllm()
    if restarted != 0:
        say(f"restarting the vllm service failed (exit {restarted}); `docker compose logs vllm` says why")
        return restarted
    return run_trainer(("--resume", "auto")) if rc == EXIT_VLLM_WENT_AWAY else run_trainer()


def run(rest: list[str]) -> int:
    return train(prepare(), rest)
