"""A deadline around blocking NCCL calls: a rendezvous that cannot complete blocks inside NCCL's C
code forever, so the rendezvous and every weight sync run under a watchdog that prints a diagnosis
and ends the process instead of hanging."""

from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

logger = logging.getLogger("trainer.gpu")

EXIT_WEIGHT_SYNC_TIMEOUT = 75  # process exit code when a watchdog fires (shows up in `docker compose ps`)


class WeightSyncTimeout(RuntimeError):
    """A rendezvous or weight sync did not finish in time; the message carries the diagnosis."""


def rendezvous_diagnosis(host_ip: str | None, port: int, seconds: float, what: str = "rendezvous") -> str:
    ip = host_ip or os.environ.get("VLLM_HOST_IP") or "?"
    ifname = os.environ.get("NCCL_SOCKET_IFNAME", "(unset)")
    return (
        f"NCCL weight-transfer {what} did not finish in {seconds:.0f}s. The trainer (rank 0) listens on "
        f"{ip}:{port}; the vLLM workers must connect to it. Check, in order:\n"
        f"  1. reachability: `docker compose exec vllm python3 -c \"import socket; "
        f"socket.create_connection(('{ip}', {port}), 5)\"`\n"
        f"  2. both containers on the same compose network, and VLLM_HOST_IP={ip} is the trainer's address "
        "on it (not 127.0.0.1 / 0.0.0.0)\n"
        f"  3. NCCL_SOCKET_IFNAME={ifname} names an interface in BOTH containers (`ip -o addr`); eth0 on a "
        "single compose network\n"
        "  4. the vllm container is alive (`docker compose logs vllm`: out of memory? crashed?)\n"
        "  5. run `make nccl-check`, then retry with NCCL_DEBUG=INFO in .env for NCCL's own log\n"
        "For very large models on the socket transport raise WEIGHT_SYNC_TIMEOUT_S."
    )


def _hard_exit(code: int) -> None:  # pragma: no cover - replaced in tests
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


@contextmanager
def watchdog(timeout_s: float, diagnose: Callable[[float], str], *, grace_s: float = 15.0,
             on_expire: Callable[[int], None] | None = None) -> Iterator[None]:
    """Run the block under a deadline. On expiry: log the diagnosis, raise WeightSyncTimeout in the
    watched thread (works when it is in Python code), and if it is stuck in C (NCCL) after grace_s,
    end the process with EXIT_WEIGHT_SYNC_TIMEOUT so the container stops instead of hanging."""
    if not timeout_s or timeout_s <= 0:
        yield
        return
    import ctypes

    done = threading.Event()
    lock = threading.Lock()
    fired = threading.Event()
    target = threading.get_ident()
    expire = on_expire or _hard_exit

    def set_async(exc) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), exc)

    def fire() -> None:
        if done.wait(timeout_s):
            return
        with lock:
            if done.is_set():
                return
            fired.set()
            set_async(ctypes.py_object(WeightSyncTimeout))
        message = diagnose(timeout_s)
        logger.error(message)
        print(f"[gpu] ERROR: {message}", file=sys.stderr, flush=True)
        if not done.wait(grace_s):
            print(f"[gpu] still blocked {grace_s:.0f}s later (inside NCCL): exiting with code "
                  f"{EXIT_WEIGHT_SYNC_TIMEOUT}", file=sys.stderr, flush=True)
            expire(EXIT_WEIGHT_SYNC_TIMEOUT)

    thread = threading.Thread(target=fire, name="weight-sync-watchdog", daemon=True)
    thread.start()
    try:
        yield
    except WeightSyncTimeout:
        with lock:
            done.set()
        raise WeightSyncTimeout(diagnose(timeout_s)) from None
    finally:
        with lock:
            done.set()
            if fired.is_set():
                set_async(None)  # the block finished first: drop an exception not yet delivered
