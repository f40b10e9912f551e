"""A hung trainer says where it is (trainer.core.hang_dump): SIGUSR1 prints every thread's stack, the process goes
on. bench/chaos.py sends it to the trainer container's processes when a run outlives its hang guard."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from trainer.core import hang_dump

BLOCKED = textwrap.dedent("""
    import sys, threading
    from trainer.core import hang_dump
    hang_dump.install()
    gate = threading.Event()
    threading.Thread(target=gate.wait, name="stuck-helper", daemon=True).start()
    print("ready", flush=True)
    sys.stdin.readline()  # blocked in C (a read), as a hung trainer is in a socket or a join
    print("went on", flush=True)
""")


def test_sigusr1_prints_each_threads_stack_and_the_process_goes_on():
    proc = subprocess.Popen([sys.executable, "-c", BLOCKED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(hang_dump.SIGNAL)  # pending before the line below is read: handled first
        out, dump = proc.communicate(input="\n", timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "went on", (proc.returncode, out, dump)  # it went on
    assert dump.count("most recent call first") >= 2, dump  # the main thread and the helper
    assert "<module>" in dump and "wait" in dump, dump  # the main thread's stack, the helper's Event.wait
