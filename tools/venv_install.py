"""`pip install <arguments>` into the host venv, done by uv when uv can be had: the same packages from the same places,
several times faster (make test's venv on a 2-core machine: ~165 s with pip, ~15 s with uv). Run by the Makefile as
`.venv/bin/python tools/venv_install.py <pip install arguments>`.

uv reads no pip configuration, so what `pip config list` shows (pip.conf files and PIP_* variables: indexes,
find-links, constraints, certificates) is handed to uv as its own flags, and uv resolves across every index as pip
does (`--index-strategy unsafe-best-match`). pip installs instead, as it always did, when a pip setting has no uv
equivalent here, when uv cannot be installed (a mirror without it) or fails, or with VENV_INSTALLER=pip.

Standard library only: it runs before the venv holds anything.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

UV = "uv>=0.5"
# pip settings (`pip config list` names, without their section) and the uv flag each becomes, one per value
AS_FLAG = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
           "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
# pip settings uv reads from the environment instead
AS_ENV = {"cert": "SSL_CERT_FILE", "client-cert": "SSL_CLIENT_CERT", "default-timeout": "UV_HTTP_TIMEOUT",
          "timeout": "UV_HTTP_TIMEOUT", "proxy": "HTTPS_PROXY"}
# pip settings about pip's own output and checks: nothing for uv to do
PIP_ONLY = {"disable-pip-version-check", "no-input", "quiet", "verbose", "progress-bar", "root-user-action",
            "no-warn-script-location", "retries", "cache-dir", "require-virtualenv", "no-color", "use-feature",
            "break-system-packages", "config-file"}
# the precedence pip applies: PIP_* variables over an [install] section over [global]
SCOPES = (":env:", "install", "global")


def pip_settings(listing: str) -> dict[str, str]:
    """`pip config list` output (`scope.name='value'` lines) as the value pip applies to `pip install` for each name."""
    found: dict[tuple[str, str], str] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        scope, dot, name = key.rpartition(".")
        if sep and dot and scope in SCOPES:
            found[scope, name] = ast.literal_eval(value)
    names = {name for _, name in found}
    return {name: next(found[s, name] for s in SCOPES if (s, name) in found) for name in sorted(names)}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """uv's flags and environment for pip's settings; None when one has no uv equivalent here (then pip installs)."""
    flags, env = ["--index-strategy", "unsafe-best-match"], {}
    for name, value in settings.items():
        if name in AS_FLAG:
            flags += [part for v in value.split() for part in (AS_FLAG[name], v)]
        elif name in AS_ENV:
            env[AS_ENV[name]] = value
        elif name == "no-index" and value.lower() in ("1", "true", "yes", "on"):
            flags.append("--no-index")
        elif name not in PIP_ONLY:
            return None
    return flags, env


def run(*cmd: str, env: dict[str, str] | None = None) -> int:
    return subprocess.call(list(cmd), env={**os.environ, **(env or {})})


def with_uv(args: list[str]) -> bool:
    """True when uv installed `args`; False, having said why on one line, when pip should."""
    python = sys.executable
    listing = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True)
    translated = uv_arguments(pip_settings(listing.stdout)) if listing.returncode == 0 else None
    if translated is None:
        print("[venv] pip's settings include one uv has no equivalent for here: pip installs", file=sys.stderr)
        return False
    flags, env = translated
    uv = Path(python).parent / "uv"
    if not uv.exists():  # pip's output only when it fails (a mirror's warnings about what it lacks are noise here)
        got = subprocess.run([python, "-m", "pip", "install", "-q", UV], capture_output=True, text=True)
        if got.returncode != 0:
            sys.stderr.write(got.stdout[-2000:] + got.stderr[-2000:])
            print("[venv] uv could not be installed (pip's message above): pip installs", file=sys.stderr)
            return False
    if run(str(uv), "pip", "install", "--python", python, *flags, *args, env=env) != 0:
        print("[venv] uv could not install these (its message above): pip tries", file=sys.stderr)
        return False
    return True


def main(args: list[str]) -> int:
    if os.environ.get("VENV_INSTALLER", "uv") != "pip" and with_uv(args):
        return 0
    python = sys.executable
    if run(python, "-m", "pip", "install", "-q", "--upgrade", "pip") != 0:
        return 1
    return run(python, "-m", "pip", "install", *args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
