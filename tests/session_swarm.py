"""`make test`'s one swarm for the whole run: `python -m tests.session_swarm up` before the container lanes start,
`down` after they end. The fleet tests need this engine in a swarm (tools.fleet.local_swarm), and a swarm leave drops
the DNS names of every container then on a user-defined network (tools.fleet.leave_local_swarm): with two lanes at
once, a fleet test's own init and leave broke name resolution in the other lane's running stack (a trainer's
`env-echo` and `vllm` no longer resolved, 2026-12-06). With the swarm made here, local_swarm finds it and leaves it.

    up    make this engine a one-node swarm if it is in none; print `created` (then `down` leaves it) or `kept`
    down  leave the swarm `up` created
"""

from __future__ import annotations

import sys

from tools import fleet
from tools.errors import StackError


def main(argv: list[str]) -> int:
    if argv == ["up"]:
        try:
            print("created" if fleet.init_local_swarm() else "kept")
        except StackError as exc:  # no engine, or no swarm possible: the fleet tests say so themselves
            print(f"[test] no swarm for this run: {exc}", file=sys.stderr)
            print("none")
        return 0
    if argv == ["down"]:
        fleet.leave_local_swarm()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
