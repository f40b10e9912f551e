"""`make doctor`'s proxy line: whether Docker injects HTTP(S)_PROXY into containers, and that the stack handles it.

The Docker CLI (and Compose) copies the client's `proxies` of ~/.docker/config.json into every container it creates
(HTTP_PROXY, HTTPS_PROXY, NO_PROXY, ... in both spellings). TRL's client (requests) and websockets >= 15 honour them,
so the stack sets NO_PROXY/no_proxy for its own names on every container that talks to another (compose.yaml's
x-no-proxy; the env servers' names: tools/compose_file.no_proxy). The daemon's own proxy (`docker info`'s
HTTPProxy/HTTPSProxy) is for its pulls and is not given to containers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlsplit

CONFIG_KEYS = {"httpProxy": "HTTP_PROXY", "httpsProxy": "HTTPS_PROXY", "ftpProxy": "FTP_PROXY", "allProxy": "ALL_PROXY"}


def client_config(path: Path | None = None) -> dict:
    """~/.docker/config.json (DOCKER_CONFIG's folder when set); {} when absent or unreadable."""
    folder = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker")
    try:
        return json.loads((path or folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def shown(url: str) -> str:
    """A proxy URL without its credentials (user:password@)."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return f"{parts.scheme}://{parts.hostname or '?'}" + (f":{parts.port}" if parts.port else "")


def injected(config: dict, docker_host: str | None = None) -> dict[str, str]:
    """The proxy variables the CLI gives containers: the `proxies` entry of this daemon's address, else `default`."""
    proxies = config.get("proxies") or {}
    entry = proxies.get(docker_host or "") or proxies.get("default") or {}
    return {CONFIG_KEYS[k]: v for k, v in entry.items() if k in CONFIG_KEYS and v}


def daemon_proxies(info: dict) -> dict[str, str]:
    """`docker info`'s proxy fields (the daemon's own, for pulls)."""
    return {k: info[k] for k in ("HTTPProxy", "HTTPSProxy") if info.get(k)}


def describe(config: dict, info: dict, docker_host: str | None = None) -> str:
    """One line for `make doctor`."""
    into = injected(config, docker_host)
    daemon = daemon_proxies(info)
    if into:
        listed = ", ".join(f"{k}={shown(v)}" for k, v in sorted(into.items()))
        return (f"Docker injects {listed} into every container (~/.docker/config.json \"proxies\"); handled: the "
                "stack sets NO_PROXY/no_proxy for its own names (vllm, trainer, env-<name>) on every container that "
                "talks to another, so only outside traffic (the Hub, pip) goes through the proxy")
    if daemon:
        listed = ", ".join(f"{k}={shown(v)}" for k, v in sorted(daemon.items()))
        return f"the Docker daemon pulls through {listed}; it injects no proxy into containers"
    return "no proxy injected into containers"
