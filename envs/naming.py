"""The rules about env names that the host (tools/) and the trainer (contract/config/) share, written once.

Standard library only: both sides import it, and it imports neither.

    ENV_NAME=echo,connect4              parse_names -> ["echo", "connect4"]  (check_names: the name rules)
    ENV_URLS=connect4=http://h:8000     parse_urls  -> {"connect4": "http://h:8000"}
    service_name("connect4")            env-connect4         (its compose service; Swarm: tasks.env-connect4)
    image_var / replicas_var            ENV_CONNECT4_IMAGE / ENV_CONNECT4_REPLICAS
    port_var / parse_port               ENV_CONNECT4_PORT: its server's port inside its container (the host resolves
                                        it once, tools/env_ports.py; the trainer reads the result, port_of)
"""

from __future__ import annotations

import re
from typing import Mapping
from urllib.parse import urlparse

NAME_PATTERN = r"[a-z][a-z0-9_]{0,30}"  # a compose service name and an environment variable's middle part
RESERVED = ("template",)  # compose.yaml's env-template service
PORT = 8000  # an env server's port inside its container unless ENV_<NAME>_PORT or its image's EXPOSE says another


def parse_names(value: str | None) -> list[str]:
    return [n.strip().lower() for n in (value or "").split(",") if n.strip()]


def check_names(names: list[str], builtin: tuple[str, ...]) -> None:
    """ValueError, one line naming the fix, for a list ENV_NAME cannot hold."""
    if not names:
        raise ValueError(f"empty; name {', '.join(builtin)} or any OpenEnv env (edit .env)")
    for name in names:
        if name in RESERVED:
            raise ValueError(f"{name!r} is reserved (compose.yaml's env-{name} service); give the env another name "
                             "(edit .env)")
        if not re.fullmatch(NAME_PATTERN, name):
            raise ValueError(f"{name!r} is not an env name: lowercase letters, digits and '_', starting with a "
                             f"letter (built in: {', '.join(builtin)}; edit .env)")
    if len(set(names)) != len(names):
        raise ValueError(f"{','.join(names)!r} names an environment twice; list each once (edit .env)")


def parse_urls(value: str | None) -> dict[str, str]:
    """ENV_URLS as {name: url}; ValueError for an item that is not `name=http(s)://host[:port]`."""
    out = {}
    for item in [i.strip() for i in (value or "").split(",") if i.strip()]:
        name, sep, url = item.partition("=")
        parsed = urlparse(url.strip())
        if not sep or not name.strip() or parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{item!r} is not `name=http://host:port`; write e.g. `echo=http://env-echo:8000` "
                             "(edit .env)")
        out[name.strip().lower()] = url.strip().rstrip("/")
    return out


def service_name(name: str) -> str:
    return f"env-{name}"


def service_url(name: str, swarm: bool = False, port: int = PORT) -> str:
    """Where the trainer finds an env served by the stack: its Compose replicas, or (ENV_FLEET=swarm) its Swarm
    tasks (`tasks.` names only the fleet's, never a Compose replica left running on this host)."""
    return f"http://{'tasks.' if swarm else ''}{service_name(name)}:{port}"


def image_var(name: str) -> str:
    return f"ENV_{name.upper()}_IMAGE"


def split_var(name: str) -> str:
    """The split an env serving OpenEnv's Task API trains on (envs.generic.tasks; default: its train split)."""
    return f"ENV_{name.upper()}_SPLIT"


def replicas_var(name: str) -> str:
    return f"ENV_{name.upper()}_REPLICAS"


def port_var(name: str) -> str:
    return f"ENV_{name.upper()}_PORT"


def parse_port(name: str, raw: str | None) -> int | None:
    """ENV_<NAME>_PORT as a port number, None when unset; ValueError, one line naming the variable and what to write."""
    text = (raw or "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{port_var(name)}={raw!r} is not a port: write the port env {name}'s server listens on "
                         f"inside its container, a number from 1 to 65535 (e.g. {port_var(name)}=8004), or leave it "
                         f"unset for the port its image EXPOSEs, else {PORT} (edit .env)")
    return int(text)


def port_of(name: str, environ: Mapping[str, str]) -> int:
    """The port the trainer reaches env `name`'s servers on: ENV_<NAME>_PORT as the stack resolved it into the
    trainer's environment (tools/compose_file.py), else PORT."""
    return parse_port(name, environ.get(port_var(name))) or PORT


# The uid:gid every env server runs as (compose.yaml's env-template says the same), whatever its image's USER says;
# ENV_<NAME>_USER=0 only for an image that needs root.
SERVER_USER = "10001:10001"


def user_var(name: str) -> str:
    return f"ENV_{name.upper()}_USER"
