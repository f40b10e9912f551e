"""`accelerate launch` with the trainer processes' rendezvous store on loopback only (SECURITY.md, issue #30).

torchrun's agent keeps an unauthenticated TCPStore (barriers, NCCL unique ids) that every trainer process uses.
Torch 2.13 binds that store to every interface whatever host it is given (TCPStore("127.0.0.1", ...) listens on
`*:port`, libuv and classic backends alike; measured), and the trainer container sits on envnet, where any env
image can connect, overwrite keys and hang or abort the run. There is no host option; what does work is the store's
`master_listen_fd`: we bind the socket ourselves to 127.0.0.1 and hand it over. All trainer processes live in one
container, so loopback reaches them all. The `loopback` rendezvous backend below is torchrun's static one with that
socket; trainer/launch.py runs `python -m trainer.run.loopback_launch <accelerate launch args> --rdzv_backend loopback`.

Gloo's and NCCL's own sockets are pinned by trainer/launch.py (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, every rank).

The launcher exits with the failing rank's own exit code. torchrun reports a failed worker by raising
ChildFailedError, which would end this process with 1 whatever the worker said; the host acts on the trainer's codes
(`make train` restarts vLLM on 76 and 77, contract/defaults.py), so with several processes they must come through too.
"""

from __future__ import annotations

import datetime
import socket
import sys

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

BACKEND = "loopback"
LOOPBACK = "127.0.0.1"


class LoopbackRendezvous(StaticTCPRendezvous):
    def get_backend(self) -> str:
        return BACKEND


def create_handler(params) -> LoopbackRendezvous:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous is for one machine (all trainer processes in one container)")
    port = int(params.get("port"))
    timeout = int(params.get("timeout", 600))
    rdzv = LoopbackRendezvous(LOOPBACK, port, 0, 1, params.run_id, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((LOOPBACK, port))
    listener.listen(512)
    # The static handler creates its store on first use unless one is there: ours, on the loopback socket.
    rdzv._store = TCPStore(LOOPBACK, port, 1, True, datetime.timedelta(seconds=timeout), multi_tenant=True,
                           master_listen_fd=listener.fileno())
    rdzv._listener = listener  # the store polls this fd: keep the socket object (and the fd) alive with it
    return rdzv


def register() -> None:
    rendezvous_handler_registry.register(BACKEND, create_handler)


def exit_code_of(failures: dict[int, int]) -> int:
    """The launcher's exit code for workers that failed ({rank: exit code}; a signal is negative): the lowest rank's
    own code (2 and up: one the trainer chose, e.g. 77 when vLLM went away), else 1. A rank that only crashed (1)
    or was killed (a signal) because another one left first does not hide that one's reason."""
    chosen = [code for _, code in sorted(failures.items()) if code >= 2]
    return chosen[0] if chosen else 1


def main(argv: list[str] | None = None) -> int:
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    register()  # accelerate runs torchrun's agent in this process: the backend is found by name
    args = launch_command_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launch_command(args)
    except ChildFailedError as exc:  # uncaught, it would print torchrun's failure table and exit 1
        failures = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        code = exit_code_of(failures)
        ranks = ", ".join(f"rank {rank} exited {c}" for rank, c in sorted(failures.items()))
        print(f"[launch] trainer processes failed ({ranks}); exit {code}", file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
