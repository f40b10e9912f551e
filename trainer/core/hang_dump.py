"""Where a hung trainer is: SIGUSR1 prints every thread's Python stack to stderr and the process goes on.

Registered in each trainer process (trainer.run.training: the single process or each rank; TRL's rollout worker
child: trainer.async_grpo.async_run). From the host, `docker compose exec trainer sh -c "$(python3 -c 'from
trainer.core.hang_dump import SIGNAL_HANDLERS; print(SIGNAL_HANDLERS)')"` (or the line below by hand) signals each
process that registered it; the stacks appear in the trainer's output (`make train`'s, `docker compose logs trainer`).
faulthandler's handler is C-level: it prints even when the thread holding the GIL is stuck in C code."""

from __future__ import annotations

import faulthandler
import signal
import sys

SIGNAL = signal.SIGUSR1
# Only the processes that catch SIGUSR1 (bit 9 of SigCgt in /proc/<pid>/status): it would end the others
# (multiprocessing's resource tracker: the run then fails on its leaked-semaphore bookkeeping).
SIGNAL_HANDLERS = ('for d in /proc/[0-9]*; do c=$(sed -n "s/^SigCgt:[[:space:]]*//p" "$d/status" 2>/dev/null); '
                   '[ -n "$c" ] && [ $((0x$c & 512)) -ne 0 ] && kill -USR1 "${d#/proc/}"; done; true')


def install() -> None:
    try:
        faulthandler.register(SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, RuntimeError, OSError):  # no SIGUSR1 (Windows), or stderr has no file descriptor
        pass
