"""`make chaos`: a real CPU training run against several env replicas while a seeded injector breaks things (#33).

    .venv/bin/python bench/chaos.py [--steps 40] [--replicas 3] [--seed 1] [--per-kind 2] [--fleet compose|swarm]

What runs: the env-echo service of the real compose.yaml with --replicas replicas (Compose's restart policy), or
(--fleet swarm) the same service as a one-node Swarm fleet (tools/fleet.py; its tasks are restarted by Swarm), and
`python -m trainer.train` on this machine (the CPU profile: the tiny model, TRL's GRPOTrainer, our rollout loop),
reaching the replicas through bench/chaos_proxy.py on 127.0.0.1 (nothing leaves this machine). The injector
(bench/chaos_faults.py) plans its faults by training step, not by second (a fast run gets as many): each kind
--per-kind times, spread over the run in a seeded order, each fired at a drawn point inside the step after its own,
as the trainer's step records (its metrics.jsonl) show that step logged; every event goes to <out>/chaos-log.jsonl:
  kill      SIGKILL an env container's server process from the host (a crash: Compose or Swarm restarts it);
  stop      SIGSTOP one for TOOL_TIMEOUT_S + 3 s, then SIGCONT (a hung server);
  drop      reset one live connection on both sides (proxy);
  half_open freeze one live connection (proxy): the trainer's side times out, the server's stays open;
  delay     every reply 1.5 s late for 10 s (a tail of slow steps, under TOOL_TIMEOUT_S);
  hostile_frames  bursts of empty control frames into one live WebSocket link for up to 5 s (proxy; alternately an
            unsolicited pong stream and a ping flood, as a hostile env image sends): the trainer's side must end that
            session (an infra failure, #63), not serve it;
and kills the trainer (SIGKILL) mid-step after each step of --kill-after (default: a third and two thirds of the
run), then starts it again (RESUME=auto). A fault that finds nothing to break (no live link, a container mid-restart)
is tried again a second later.

    .venv/bin/python bench/chaos.py --rollouts async [--steps 20] [--vllm-restart-after N]   (make chaos ARGS=...)

runs the same plan and figures against `python -m tools rehearse` with ROLLOUTS=async (TRL's AsyncGRPOTrainer in the
trainer container on the vLLM CPU twin) on a Compose project of its own: the replicas as above, the proxy in a container
on their network and on the rehearsal's envnet (the trainer's ENV_URLS points at it by name); the trainer kills are a
`docker kill` of the trainer container, and one more fault, vllm_restart, SIGKILLs the twin after step
--vllm-restart-after (default: a quarter of the run; the trainer kills then at a half and three quarters): make
rehearse's recovery (tools/commands/train.py `recovering`) must recreate it and resume from the last checkpoint.
Episodes in async are the worker's (env/echo/episodes of each step record), infra failures its rollout/infra_failures,
both per step as in sync. Extra figure: the twin's restart, recovered, resumed from.

    .venv/bin/python bench/chaos.py --rollouts async --judge /models/tiny-qwen3 [--judge-restart-after N]

adds a judge to that run (JUDGE_MODEL: make rehearse starts the judge service on the vLLM CPU twin, the trainers wait
for it healthy; here the tiny model the run trains) and one more fault, judge_restart: the judge container SIGKILLed at
a drawn point of the step after --judge-restart-after (default: between the twin's restart and the first trainer kill),
the moment its vLLM has a judge call running or waiting (its /metrics, polled in the container: the kill lands on live
traffic) while the trainer is training (a step logged since the last restart: not a start's preflight call), started
again JUDGE_DOWN_S later; every episode is a judge call (JUDGE_CACHE_SIZE=0: chaos_stack.JUDGE_SETTINGS). Extra figures: the calls in flight at the kill, the rows its death failed
(the trainer's judge/failures: left out of the loss, never a 0 reward), the traced rollouts whose judge call failed by
what their reason says (cut by the kill, made while the judge was down) and how many of them have a reward (goal 0),
the judge back healthy.

Figures, each beside its goal, after the count of each fault kind injected (goal: --per-kind each, the trainer kills and
the twin's restart as asked) (a benchmark: it prints, it never fails on a figure; tests/reliability/test_chaos.py runs a
short version and asserts what must hold):
  replies paired with the wrong request   0     every traced call's result checked against its own request
  episodes lost to infrastructure         <=1 % rollout/infra_failures over every episode trained
  session slots held at the end           0     every replica's /health once the trainer is gone (bounded wait)
  optimizer steps lost or repeated        0     across the trainer kills: steps 1..N logged once each, the resumed
                                                  run continues from its checkpoint, trainer_state ends at N
  stalls ended within bound, diagnosed    all   each stop/half_open: the next step came within its bound and a
                                                  one-line diagnosis of its own is in the trainer's log after it (a
                                                  line naming one of the fault's links: bench/chaos_figures.own_lines;
                                                  a stop inside a trainer or vLLM restart, or after the last step,
                                                  and a half-open link a restart closed before the client gave up on
                                                  it, are listed apart: nothing to time them by)
  floods ended by the client              all   each hostile_frames: the trainer's side closed that link first, within
                                                  HOSTILE_BOUND_S (not an env fault, a restart or the run's end)

Split by concern: bench/chaos_stack.py (the replicas, the proxy container, the trainer), bench/chaos_faults.py (the
injector), bench/chaos_figures.py (the figures); this file drives a run.
"""

from __future__ import annotations

import argparse
import json
import threading
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chaos_faults import PER_KIND, Injector, plan  # noqa: E402
from bench.chaos_figures import figures, print_figures  # noqa: E402
from bench.chaos_proxy import ChaosProxy  # noqa: E402
from bench.chaos_stack import (  # noqa: E402
    ComposeEnvs, Rehearsal, RemoteProxy, SwarmEnvs, Trainer, log, make_model, proxy_container, sh)

POLL_S = {False: 0.25, True: 0.5}  # how often the step records are read: a local file; async: a docker exec
SLOTS_BOUND_S = 100  # a freed slot shows in /health within: the server's ping (20 s) + its timeout (60 s) + margin


# ---------------------------------------------------------------------------- the run
def run(args) -> dict:
    from contract.config import RunConfig

    work = Path(args.out or tempfile.mkdtemp(prefix="chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(Path(args.model_cache))
    envs = (SwarmEnvs if args.fleet == "swarm" else ComposeEnvs)(args.replicas, args.project, work)
    proxy = trainer = None
    rehearsal = args.rollouts == "async"
    t0 = time.monotonic()
    try:
        backends = envs.up()
        log(f"{args.replicas} env-echo replicas ({args.fleet})"
            + (f" on {', '.join(f'{h}:{p}' for h, p in backends)}" if backends else ""))
        if rehearsal:  # the trainer container reaches the proxy's container by name on its envnet
            proxy_name = f"{args.project}-proxy"
            trainer = Rehearsal(model, f"http://{proxy_name}:9000", work, args.steps, args.seed, args.project,
                                judge=args.judge)
            proxy, _ = proxy_container(proxy_name, f"{args.project}_envnet", "env-echo:8000", args.seed,
                                       also=(trainer.envnet,))
            generation_batch = None  # async: episodes read from the step records (figures)
        else:
            proxy, url = envs.proxy(backends, args.seed)
            trainer = Trainer(model, url, work / "outputs", args.steps, args.seed)
            generation_batch = RunConfig.load([], **{"env_name": "echo"}).generation_batch_size
        planned = plan(args.steps, args.seed, args.per_kind, tuple(args.kill_after),
                       args.vllm_restart_after if rehearsal else None, args.judge_restart_after if args.judge else None)
        injector = Injector(envs, proxy, args.seed, planned, work / "chaos-log.jsonl",
                            judge=(lambda: trainer.container("judge")) if args.judge else None)
        log(f"faults planned by step: {', '.join(f'{p.kind}@{p.after_step}' for p in planned)}")
        trainer.start("fresh")
        killed_at: list[dict] = []
        vllm_killed = 0.0
        firing: dict[int, threading.Thread] = {}  # env faults off the loop: each is a few Docker calls, and the loop
        # must see a restart's step as soon as it is logged (an async step can end while faults are being fired)
        deadline = time.monotonic() + args.guard_s  # a hang guard only
        while trainer.proc.poll() is None:
            # the trainer's progress: its step records (metrics.jsonl), each with the wall time it was logged
            done = trainer.steps_logged()
            due = injector.due(done, time.time())
            for fault in sorted(due, key=lambda p: p.kind not in ("vllm_restart", "trainer_kill")):  # restarts first
                if fault.kind == "vllm_restart":
                    vllm_killed = time.monotonic()
                    injector.fault_vllm_restart(trainer, done[-1]["step"])
                    injector.done(fault)
                elif fault.kind == "trainer_kill":
                    if trainer.proc.poll() is None:
                        last = trainer.steps_logged()[-1]["step"]
                        at = time.time()  # before the kill: every link the trainer held closes with it
                        trainer.kill()
                        killed_at.append({"after_step": last, "time": at})
                        injector.record("trainer_kill", when=at, after_step=last)
                        trainer.start("auto")
                    injector.done(fault)
                elif not (id(fault) in firing and firing[id(fault)].is_alive()):
                    firing[id(fault)] = threading.Thread(target=injector.fire, args=(fault,), daemon=True)
                    firing[id(fault)].start()
            if rehearsal and vllm_killed and time.monotonic() - vllm_killed > args.vllm_bound_s and not any(
                    "restarting the vllm service" in text for _, text in trainer.lines):
                seen = last_lines(trainer)
                trainer.kill()  # a stall past its bound: one line, not a wait for ever
                raise SystemExit(f"the trainer did not stop for the killed vLLM twin within {args.vllm_bound_s:.0f} s "
                                 f"(no exit 77, no restart): see {work}; the trainer's last lines:\n{seen}")
            if time.monotonic() > deadline:
                seen = last_lines(trainer)  # before the kill: which container was still up
                trainer.kill()
                raise SystemExit(f"the run did not finish in {args.guard_s} s (a hang): see {work}; "
                                 f"the trainer's last lines:\n{seen}")
            time.sleep(POLL_S[rehearsal])  # a poll of the step records, not a wait for something
        for thread in firing.values():
            thread.join()
        injector.end()
        exit_code = trainer.proc.returncode
        if rehearsal:
            trainer.collect()
        if exit_code != 0:
            raise SystemExit(f"the trainer exited {exit_code}:\n{last_lines(trainer)}")
        proxy.close()  # frozen links stay: the servers must free their slots by themselves
        start = time.monotonic()
        while True:  # until every replica shows no session, or the bound
            held = envs.held(backends, proxy)
            if all(v == 0 for v in held.values()) or time.monotonic() - start > SLOTS_BOUND_S:
                break
            time.sleep(1)
        slots = {"held": held, "after_s": time.monotonic() - start}
        result = figures(args, trainer, injector, killed_at, slots, time.monotonic() - t0, generation_batch)
        (work / "chaos-figures.json").write_text(json.dumps(result, indent=2))
        (work / "trainer.log").write_text("\n".join(f"{t:.3f} {text}" for t, text in trainer.lines))
        print_figures(result)
        log(f"log of faults: {work / 'chaos-log.jsonl'}; trainer log: {work / 'trainer.log'}")
        return result
    finally:
        if isinstance(proxy, ChaosProxy):
            for link in proxy.frozen:
                link.server.transport.abort()
        if not args.keep:
            if isinstance(proxy, RemoteProxy) and rehearsal:
                sh("docker", "rm", "-f", f"{args.project}-proxy", check=False)
            if isinstance(trainer, Rehearsal):
                trainer.down()
            envs.down()


def last_lines(trainer, n: int = 60) -> str:
    """What a failed run ends with: the trainer's own last lines (its work folder may be gone with the test's); for a
    rehearsal still running (a hang), its threads' stacks and containers too (Rehearsal.state)."""
    lines = "\n".join(text for _, text in trainer.lines[-n:])
    state = getattr(trainer, "state", None)
    return lines + (f"\n{state()}" if state and trainer.proc.poll() is None else "")


def steps_list(text: str) -> list[int]:
    """--kill-after: "13,26" -> [13, 26]; "0" -> [] (no trainer kill)."""
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: step numbers, comma separated (0: none)") from None
    return [s for s in steps if s != 0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--per-kind", type=int, default=PER_KIND, help="faults of each kind in the run (kill, stop, drop, "
                   f"half_open, delay, hostile_frames), spread over its steps (default {PER_KIND})")
    p.add_argument("--kill-after", type=steps_list, default=None, help="kill the trainer after these steps, comma "
                   "separated (default: at a third and two thirds of the run; 0: no trainer kill)")
    p.add_argument("--fleet", choices=["compose", "swarm"], default="compose")
    p.add_argument("--rollouts", choices=["sync", "async"], default="sync", help="async: a `make rehearse` run with "
                   "ROLLOUTS=async (the vLLM CPU twin), and the twin killed once mid-run (vllm_restart)")
    p.add_argument("--vllm-restart-after", type=int, default=None, help="async: kill the twin after this step "
                   "(default: steps/4; the trainer kills then at steps/2 and 3 steps/4)")
    p.add_argument("--vllm-bound-s", type=float, default=300.0, help="async: the trainer must stop for the killed "
                   "twin (exit 77, make rehearse restarts it) within this (else the run ends with one line)")
    p.add_argument("--judge", default=None, metavar="MODEL", help="async: the run has a judge the stack serves "
                   "(JUDGE_MODEL, e.g. /models/tiny-qwen3: the twin serves the tiny model), killed once mid-run "
                   "(judge_restart)")
    p.add_argument("--judge-restart-after", type=int, default=None, help="--judge: kill the judge after this step "
                   "(default: between the twin's restart and the first trainer kill)")
    p.add_argument("--project", default="grpo-test-chaos")
    p.add_argument("--out", default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "grpo-chaos-model"))
    p.add_argument("--step-allowance-s", type=float, default=60.0, help="a step's own time on this machine, added to "
                   "the stall bound (a busy 2-core machine takes tens of seconds per step)")
    p.add_argument("--guard-s", type=float, default=3600)
    p.add_argument("--keep", action="store_true", help="leave the env containers running")
    args = p.parse_args(argv)
    restarts = 3 if args.rollouts == "async" else 2  # evenly spaced: (the twin,) then two trainer kills
    at = [args.steps * (i + 1) // (restarts + 1) for i in range(restarts)]
    if args.vllm_restart_after is None:
        args.vllm_restart_after = at[0] if args.rollouts == "async" else max(1, args.steps // 4)
    if args.kill_after is None:
        args.kill_after = at[-2:]
    twin = [args.vllm_restart_after] if args.rollouts == "async" else []
    if any(not 1 <= s < args.steps for s in args.kill_after + twin) or len(set(args.kill_after + twin)) < len(
            args.kill_after + twin):
        p.error(f"--kill-after {args.kill_after} / --vllm-restart-after: distinct steps in 1..{args.steps - 1} "
                "(a restart after the last step has no step to resume)")
    if args.rollouts == "async" and args.fleet != "compose":
        p.error("--rollouts async runs on the compose fleet (make rehearse's own project)")
    if args.judge and args.rollouts != "async":
        p.error("--judge needs --rollouts async: the judge is a service of make rehearse's stack (the sync run's "
                "trainer runs on this machine, off agentnet)")
    if args.judge and args.judge_restart_after is None:
        args.judge_restart_after = max(1, (args.vllm_restart_after + min(args.kill_after or [args.steps - 1])) // 2)
    if args.judge and not 1 <= args.judge_restart_after < args.steps - 1:
        p.error(f"--judge-restart-after {args.judge_restart_after}: a step in 1..{args.steps - 2} (a step after it "
                "must show what the dead judge did)")
    return args


if __name__ == "__main__":
    run(parse_args())
