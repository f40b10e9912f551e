"""One trainer per run: rank 0 holds an exclusive flock on OUTPUT_DIR/.<RUN_NAME>.lock for its whole life, taken
before RESUME=fresh deletes anything. A second `make train` on the same run (or a trainer container left behind)
stops at once with one line naming the holder, instead of deleting the first one's checkpoints while they are saved
or joining vLLM's weight sync with a second policy.

The lock file sits beside the run folder, not in it: RESUME=fresh deletes the folder, and a lock on a deleted file
locks nothing. The kernel drops the lock when the holding process dies however it dies, so a crash leaves no stale
lock (the file stays, unlocked, naming the last holder). flock is per open file on one kernel: it holds between
containers sharing a volume on one host (Docker volumes and bind mounts are that host's filesystem).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

_held: dict[str, int] = {}  # lock path -> fd, open for the process's life (closing it would drop the lock)


class RunLocked(RuntimeError):
    """One line: who holds the run and what to do."""


def lock_path(output_dir: str, run_name: str) -> Path:
    return Path(output_dir) / f".{run_name}.lock"


def acquire(output_dir: str, run_name: str) -> Path:
    """Take the run's lock for this process's lifetime, or raise RunLocked naming the holder."""
    path = lock_path(output_dir, run_name)
    if str(path) in _held:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe(_read(fd))
        os.close(fd)
        raise RunLocked(f"run {run_name} is in use by another trainer ({holder}); stop it first (`make down`, or "
                        f"wait for it to finish), or train under another RUN_NAME") from None
    except BaseException:
        os.close(fd)
        raise
    info = {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    os.fsync(fd)
    _held[str(path)] = fd
    return path


def _read(fd: int) -> Optional[dict]:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"null")
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def _describe(info: Optional[dict]) -> str:
    if not info:
        return "holder not recorded yet"
    # Under Compose the host name is the trainer container's id: `docker ps | grep <it>` finds it.
    return (f"host {str(info.get('host', '?'))[:64]} (a container id under Compose), pid {info.get('pid', '?')}, "
            f"since {str(info.get('started', '?'))[:32]}")
