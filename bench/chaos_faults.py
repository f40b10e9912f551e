"""`make chaos`'s injector (bench/chaos.py): seeded faults at random times against the env replicas and the proxy
(bench/chaos_stack.py), every event logged with its wall time."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

from bench.chaos_proxy import ChaosProxy
from bench.chaos_stack import TOOL_TIMEOUT_S, Rehearsal, log, pid_of, sh

KINDS = {"kill": 1.0, "stop": 1.0, "drop": 2.0, "half_open": 1.0, "delay": 1.0}


# ---------------------------------------------------------------------------- the injector
class Injector:
    """Seeded faults at random times while `active`; every event logged (JSONL) with its wall time."""

    def __init__(self, envs, proxy: ChaosProxy, seed: int, rate: float, log_path: Path) -> None:
        self.envs, self.proxy = envs, proxy
        self.random = random.Random(seed)
        self.mean_gap_s = 30.0 / rate
        self.log_path = log_path
        self.events: list[dict] = []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos-injector", daemon=True)

    def record(self, kind: str, **detail) -> dict:
        event = {"time": time.time(), "kind": kind, **detail}
        self.events.append(event)
        with open(self.log_path, "a") as fh:
            fh.write(json.dumps(event) + "\n")
        log(f"inject {kind} {json.dumps(detail)}")
        return event

    def start(self) -> None:
        self.thread.start()

    def end(self) -> None:
        self.stop_event.set()
        self.thread.join(60)

    def _run(self) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        while not self.stop_event.wait(self.random.expovariate(1 / self.mean_gap_s)):
            kind = self.random.choices(kinds, weights)[0]
            try:
                getattr(self, f"fault_{kind}")()
            except Exception as exc:  # a container mid-restart: logged, the run goes on
                self.record(kind, error=f"{type(exc).__name__}: {exc}")

    def fault_kill(self) -> None:
        target = self.random.choice(self.envs.targets())
        pid = pid_of(target)
        if pid:
            os.kill(pid, signal.SIGKILL)
        self.record("kill", container=target[:12], pid=pid)

    def fault_stop(self) -> None:
        target = self.random.choice(self.envs.targets())
        pid = pid_of(target)
        hold = TOOL_TIMEOUT_S + 3
        backend = self.envs.backend_of(target)
        os.kill(pid, signal.SIGSTOP)
        event = self.record("stop", container=target[:12], pid=pid, hold_s=hold, backend=backend)
        time.sleep(hold)  # the fault's length, not a synchronisation
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        event["continued"] = time.time()

    def fault_drop(self) -> None:
        self.record("drop", **(self.proxy.drop() or {"link": None}))

    def fault_half_open(self) -> None:
        self.record("half_open", **(self.proxy.half_open() or {"link": None}))

    def fault_delay(self) -> None:
        self.proxy.delay(1.5, 10.0)
        self.record("delay", seconds=1.5, for_s=10.0)

    def fault_vllm_restart(self, trainer: "Rehearsal", after_step: int) -> None:
        """SIGKILL the twin (a crash): make rehearse's recovery must recreate it and resume (tools/commands/train)."""
        container = trainer.container("vllm")
        sh("docker", "kill", container)
        self.record("vllm_restart", container=container[:12], after_step=after_step)
