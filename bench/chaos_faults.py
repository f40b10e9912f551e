"""`make chaos`'s injector (bench/chaos.py): a seeded plan of faults by training step (`plan`), fired as the trainer
logs its steps (`Injector.due`, fed the run's metrics.jsonl step records), against the env replicas and the proxy
(bench/chaos_stack.py), and the judge container of a run with a judge; every event logged with its wall time.

By step, not by second: a run's faults must not thin out as its steps get faster (#63 item 8: at one fault per 30 s
a 40-step run of 39 s drew one delay and the trainer kill). A default run gets every kind PER_KIND times."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.chaos_proxy import ChaosProxy
from bench.chaos_stack import TOOL_TIMEOUT_S, Rehearsal, log, pid_of, sh

ENV_KINDS = ("kill", "stop", "drop", "half_open", "delay", "hostile_frames")  # the injector's own
RESTARTS = ("trainer_kill", "vllm_restart")  # the driver's (bench/chaos.py): each restarts the run
JUDGE_KINDS = ("judge_restart",)  # a run with a judge (--judge): its container SIGKILLed mid-step, started again
KINDS = ENV_KINDS + RESTARTS + JUDGE_KINDS
JUDGE_DOWN_S = 5.0  # the judge stays dead this long before it is started again: calls made meanwhile fail
JUDGE_BACK_BOUND_S = 600.0  # how long the injector follows the started judge to healthy (the twin: ~40 s idle)
JUDGE_BUSY_WAIT_S = 10.0  # one try of judge_restart waits this long for a judge call in flight, else it is tried again
# In the judge's container: its vLLM's /metrics polled until a request is running or waiting there, then one JSON line
# (the counts), then it waits for its stdin to close (the driver's `docker exec -i`: the kill, or no kill after all);
# "{}" when none came within argv[1] seconds. argv[2]: the port (a test's stand-in server; the judge's is 8000).
JUDGE_BUSY = """
import json, re, sys, time, urllib.request
deadline = time.monotonic() + float(sys.argv[1])
url = "http://127.0.0.1:%s/metrics" % (sys.argv[2] if len(sys.argv) > 2 else "8000")
while time.monotonic() < deadline:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except Exception:
        time.sleep(0.2)
        continue
    n = {k: sum(float(v) for v in re.findall(r"^vllm:num_requests_" + k + r"(?:{[^}]*})? ([0-9.eE+-]+)$", text, re.M))
         for k in ("running", "waiting")}
    if n["running"] + n["waiting"] > 0:
        print(json.dumps(n), flush=True)
        sys.stdin.read()
        sys.exit(0)
    time.sleep(0.02)
print("{}", flush=True)
"""
PER_KIND = 2
RETRY_S = 1.0  # a fault that found nothing to break (no live link, a container mid-restart) is tried again this late
STEP_S_UNKNOWN = 2.0  # a step's time before two consecutive steps were seen


@dataclass(frozen=True)
class Planned:
    after_step: int  # fired once the trainer has logged this step ...
    kind: str
    into: float  # ... this share of a step's time after that step's record: where inside the next step it lands
    variant: str = ""  # hostile_frames: "pong" (an unsolicited pong stream) or "ping" (a ping flood)


def plan(steps: int, seed: int, per_kind: int = PER_KIND, trainer_kills: tuple[int, ...] = (),
         vllm_restart: int | None = None, judge_restart: int | None = None) -> list[Planned]:
    """Every env kind `per_kind` times, spread evenly over steps 1..steps-2 in a seeded order (several to a step when
    there are more faults than steps; a whole step after the fault's own is left to time what it did and to try a
    fault again that found nothing to break), none after the step of a restart (it would land in the restart,
    untimed); the restarts after their own steps; a run with a judge, its judge killed and started again at a drawn
    point of the step after `judge_restart` (drawn last: a seed's other faults are the same with a judge or without)."""
    rng = random.Random(seed)
    restarts = [Planned(s, "trainer_kill", rng.uniform(0.2, 0.8)) for s in trainer_kills]
    if vllm_restart:
        restarts.append(Planned(vllm_restart, "vllm_restart", 0.0))
    # none on a restart's step, nor (the twin's restart) on the step before it: a burst of Docker calls there slows the
    # driver's reads of the step records, and an async run can log the next steps within seconds (CI: the twin was
    # killed only after the last step)
    quiet = {p.after_step for p in restarts} | ({vllm_restart - 1} if vllm_restart else set())
    slots = [s for s in range(1, steps - 1) if s not in quiet] or [1]
    kinds = [kind for kind in ENV_KINDS for _ in range(per_kind)]
    rng.shuffle(kinds)
    variants = itertools.cycle(("pong", "ping"))
    faults = [Planned(slots[i * len(slots) // len(kinds)], kind, rng.uniform(0.1, 0.9),
                      next(variants) if kind == "hostile_frames" else "") for i, kind in enumerate(kinds)]
    if judge_restart:
        faults.append(Planned(judge_restart, "judge_restart", rng.uniform(0.2, 0.8)))
    return sorted(restarts + faults, key=lambda p: (p.after_step, p.into))


# ---------------------------------------------------------------------------- the injector
class Injector:
    """The plan's faults, each fired once its step is logged and its share of the next step has passed; one that
    found nothing to break is tried again RETRY_S later until the run ends. Every event logged (JSONL)."""

    def __init__(self, envs, proxy: ChaosProxy, seed: int, planned: list[Planned], log_path: Path,
                 judge=None) -> None:
        self.envs, self.proxy = envs, proxy
        self.judge = judge  # a run with a judge: () -> its container's id ("" while there is none)
        self.random = random.Random(seed)
        self.planned = list(planned)
        self.pending = list(planned)
        self.retry_at: dict[int, float] = {}  # id(Planned) -> wall clock
        self.seen: dict[int, float] = {}  # step -> its record's wall time, first seen (a resume rewrites later ones)
        self.latest = 0.0  # the wall time of the latest step record (a resumed run's included)
        self.log_path = log_path
        self.events: list[dict] = []
        self.stopped: set[str] = set()  # containers SIGSTOPped now (a second stop picks another)
        self.timers: list[threading.Timer] = []

    def record(self, kind: str, when: float | None = None, **detail) -> dict:
        """`when`: the fault's start, when that came before its record (a trainer kill waits for the process)."""
        event = {"time": when or time.time(), "kind": kind, **detail}
        self.events.append(event)
        with open(self.log_path, "a") as fh:
            fh.write(json.dumps(event) + "\n")
        log(f"inject {kind} {json.dumps(detail)}")
        return event

    def step_s(self) -> float:
        """A step's time now: the median of the last five between consecutive steps seen."""
        gaps = [self.seen[s] - self.seen[s - 1] for s in sorted(self.seen) if s - 1 in self.seen]
        gaps = [g for g in gaps[-5:] if g > 0]
        return statistics.median(gaps) if gaps else STEP_S_UNKNOWN

    def due(self, rows: list[dict], now: float) -> list[Planned]:
        """The planned faults due at `now` (wall clock), given the step records logged so far."""
        for row in rows:
            self.seen.setdefault(row["step"], row["time"])
            self.latest = max(self.latest, row["time"])
        step_s = self.step_s()
        return [p for p in self.pending if p.after_step in self.seen and now >= self.retry_at.get(id(p), 0.0)
                and now >= self.seen[p.after_step] + p.into * step_s
                and (p.kind not in JUDGE_KINDS or self.training())]

    def training(self) -> bool:
        """A step logged since the last restart (a trainer kill, the twin's): the trainer is training, not starting.
        The judge is killed only then: a trainer starting calls it too (preflight's test episode), and a kill there
        stops that start (exit 3), not what this fault is about (calls made by a run that must go on)."""
        restarts = [e["time"] for e in self.events if e["kind"] in RESTARTS and not e.get("error")]
        return self.latest > max(restarts, default=0.0)

    def done(self, planned: Planned) -> None:
        self.pending.remove(planned)

    def fire(self, planned: Planned) -> bool:
        """An env fault now; False (tried again later) when it found nothing to break."""
        try:
            effective = getattr(self, f"fault_{planned.kind}")(planned)
        except Exception as exc:  # a container mid-restart: logged, tried again
            self.record(planned.kind, error=f"{type(exc).__name__}: {exc}")
            effective = False
        if effective:
            self.done(planned)
        else:
            self.retry_at[id(planned)] = time.time() + RETRY_S
        return effective

    def end(self) -> None:
        """Every stopped server continued (its hold is the fault's length), and a killed judge started again and
        followed to healthy, before the run's figures are read."""
        for timer in self.timers:
            timer.join(TOOL_TIMEOUT_S + 30 + JUDGE_BACK_BOUND_S)

    def counts(self) -> dict[str, int]:
        return {k: sum(1 for e in self.events if e["kind"] == k and not e.get("error")) for k in KINDS}

    def fault_kill(self, planned: Planned) -> bool:
        target = self.random.choice(self.envs.targets())
        pid = pid_of(target)
        if not pid:
            raise RuntimeError(f"{target[:12]} has no process (restarting)")
        os.kill(pid, signal.SIGKILL)
        self.record("kill", container=target[:12], pid=pid, after_step=planned.after_step)
        return True

    def fault_stop(self, planned: Planned) -> bool:
        target = self.random.choice([t for t in self.envs.targets() if t not in self.stopped])
        pid = pid_of(target)
        if not pid:  # never os.kill(0, ...): that would stop this process group
            raise RuntimeError(f"{target[:12]} has no process (restarting)")
        hold = TOOL_TIMEOUT_S + 3
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(target)
        event = self.record("stop", container=target[:12], pid=pid, hold_s=hold, backend=self.envs.backend_of(target),
                            after_step=planned.after_step)
        timer = threading.Timer(hold, self._continue, args=(target, pid, event))  # the fault's length
        timer.daemon = True
        timer.start()
        self.timers.append(timer)
        return True

    def _continue(self, target: str, pid: int, event: dict) -> None:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        event["continued"] = time.time()
        self.stopped.discard(target)

    def _on_link(self, kind: str, planned: Planned, got: dict | None) -> bool:
        if got is None:
            self.record(kind, error="no live link", after_step=planned.after_step)
            return False
        self.record(kind, **got, after_step=planned.after_step)
        return True

    def fault_drop(self, planned: Planned) -> bool:
        return self._on_link("drop", planned, self.proxy.drop())

    def fault_half_open(self, planned: Planned) -> bool:
        return self._on_link("half_open", planned, self.proxy.half_open())

    def fault_hostile_frames(self, planned: Planned) -> bool:
        return self._on_link("hostile_frames", planned, self.proxy.hostile_frames(planned.variant or "pong"))

    def fault_delay(self, planned: Planned) -> bool:
        self.proxy.delay(1.5, 10.0)
        self.record("delay", seconds=1.5, for_s=10.0, after_step=planned.after_step)
        return True

    def fault_judge_restart(self, planned: Planned) -> bool:
        """SIGKILL the judge container (a crash) while a judge call is in flight there (its vLLM's /metrics: a
        request running or waiting; none within JUDGE_BUSY_WAIT_S: tried again later), so the kill lands on live
        traffic: the calls in flight fail, and those made while it is down. Started again JUDGE_DOWN_S later and
        followed back to healthy (the event's `in_flight`, `started` and `healthy`)."""
        container = self.judge() if self.judge else ""
        if not container:
            raise RuntimeError("no judge container (starting)")
        in_flight = judge_in_flight(container, JUDGE_BUSY_WAIT_S, kill=self.training)
        if not in_flight:
            self.record("judge_restart", error=f"no judge call of a training run in flight within "
                        f"{JUDGE_BUSY_WAIT_S:.0f} s", after_step=planned.after_step)
            return False
        event = self.record("judge_restart", container=container[:12], down_s=JUDGE_DOWN_S,
                            in_flight=in_flight, after_step=planned.after_step)
        timer = threading.Timer(JUDGE_DOWN_S, self._judge_back, args=(container, event))
        timer.daemon = True
        timer.start()
        self.timers.append(timer)
        return True

    def _judge_back(self, container: str, event: dict) -> None:
        sh("docker", "start", container, check=False)
        event["started"] = time.time()
        deadline = time.monotonic() + JUDGE_BACK_BOUND_S
        while time.monotonic() < deadline:  # a poll of its health, for the figure, not a wait for the run
            if sh("docker", "inspect", "-f", "{{.State.Health.Status}}", container, check=False) == "healthy":
                event["healthy"] = time.time()
                return
            time.sleep(1)

    def fault_vllm_restart(self, trainer: "Rehearsal", after_step: int) -> None:
        """SIGKILL the twin (a crash): make rehearse's recovery must recreate it and resume (tools/commands/train)."""
        container = trainer.container("vllm")
        sh("docker", "kill", container)
        self.record("vllm_restart", container=container[:12], after_step=after_step)


def judge_in_flight(container: str, wait_s: float, kill: Callable[[], bool]) -> dict[str, float]:
    """The judge's requests running and waiting once some are (JUDGE_BUSY in its container), {} when none came within
    `wait_s`; the container SIGKILLed the moment the poller says so (before `docker exec` has returned: the calls it
    saw are then still in flight) when `kill()` says so then, else {}."""
    poller = subprocess.Popen(["docker", "exec", "-i", container, "python3", "-c", JUDGE_BUSY, str(wait_s)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = poller.stdout.readline()
        try:
            seen = json.loads(line) if line.strip() else {}
        except ValueError:
            seen = {}
        if not seen or not kill():
            return {}
        sh("docker", "kill", container)
        return seen
    finally:
        poller.stdin.close()  # the poller's end, if the kill has not ended it with the container
        try:
            poller.wait(timeout=120)
        except subprocess.TimeoutExpired:
            poller.kill()
            poller.wait()
