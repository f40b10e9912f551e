"""ENV_<NAME>_PORT: the port each env's server listens on inside its container, resolved once per env for everything
that reaches it (the published port, the health checks, the capacity probe, the trainer's URL, the messages).

    ENV_CALENDAR_ENV_PORT=8004 in .env      -> 8004, "ENV_CALENDAR_ENV_PORT in .env"
    unset, the image EXPOSEs one TCP port    -> that port, "the image's EXPOSE"
    unset, our image, or none / several      -> naming.PORT (8000), "the default; set ENV_<NAME>_PORT if ..." (several:
                                                one line said)

Pure: the EXPOSE lines come from docker_host.exposed_ports (read where the stack inspects and pulls images).
"""

from __future__ import annotations

from dataclasses import dataclass

from envs import naming
from tools.env_kinds import EnvKinds
from tools.errors import StackError


@dataclass(frozen=True)
class EnvPort:
    """The port an env's server listens on inside its container, and where that number came from (said in every
    message about reaching it)."""

    port: int
    source: str  # "ENV_X_PORT in .env" | "the image's EXPOSE" | "the default; set ENV_X_PORT if ..."

    def __str__(self) -> str:
        return f"port {self.port}, {self.source}"


def default(name: str) -> EnvPort:
    return EnvPort(naming.PORT, f"the default; set {naming.port_var(name)} if the server listens elsewhere")


def resolve(envs: EnvKinds, values: dict[str, str],
            exposed: dict[str, tuple[str, ...]]) -> tuple[dict[str, EnvPort], list[str]]:
    """({env: its port}, lines to say) for each env served here, resolved once: ENV_<NAME>_PORT when set, else the
    one TCP port its image EXPOSEs, else naming.PORT (our image, an image that exposes none, or several: said).
    `exposed`: the EXPOSE entries (`8004/tcp`) of each image not ours that is on this machine, by env
    (docker_host.exposed_ports); an env left out gets the default until its image is here."""
    ports, lines = {}, []
    for n in envs.served_here:
        var = naming.port_var(n)
        try:
            given = naming.parse_port(n, values.get(var))
        except ValueError as exc:
            raise StackError(str(exc)) from None
        tcp, bad = exposed_tcp(exposed.get(n, ()))
        if bad and given is None:
            lines.append(f"env {n}: its image {envs.images.get(n)} EXPOSEs {', '.join(bad)}, not a TCP port "
                         f"(1-65535): ignored, looking for its server on {tcp[0] if len(tcp) == 1 else naming.PORT}; "
                         f"set {var}=<port> in .env if it listens on another")
        if given is not None:
            ports[n] = EnvPort(given, f"{var} in .env")
        elif len(tcp) == 1:
            ports[n] = EnvPort(tcp[0], "the image's EXPOSE")
        else:
            ports[n] = default(n)
            if tcp:
                lines.append(f"env {n}: its image {envs.images.get(n)} EXPOSEs ports {', '.join(map(str, tcp))}; "
                             f"looking for its server on {naming.PORT}, the default: set {var}=<port> in .env if it "
                             "listens on another")
    return ports, lines


def exposed_tcp(entries: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """(the TCP ports an image's EXPOSE entries name, sorted; the entries that name none, shown escaped). A port is
    ASCII digits within 1-65535 (#63: `0/tcp` and `70000/tcp` were taken, and blamed later on ENV_X_PORT; a non-ASCII
    digit ended `make up` in a traceback); UDP and SCTP entries are no server's port here and are left out quietly."""
    ports, bad = set(), []
    for entry in entries:
        number, _, protocol = str(entry).partition("/")
        if protocol in ("udp", "sctp"):
            continue
        if protocol == "tcp" and number.isascii() and number.isdigit() and 1 <= int(number) <= 65535:
            ports.add(int(number))
        else:
            bad.append(ascii(str(entry))[:40])
    return sorted(ports), bad


def compose_vars(ports: dict[str, EnvPort]) -> dict[str, str]:
    """ENV_<NAME>_PORT as Compose interpolates it into the generated env services and the trainers' environment."""
    return {naming.port_var(n): str(p.port) for n, p in ports.items()}
