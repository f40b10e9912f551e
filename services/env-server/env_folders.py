"""What the env-server image installs and builds, read from the repo: run by the Dockerfile's `reqs` stage.

    python3 env_folders.py SRC OUT

SRC holds `pyproject.toml` and `envs/`. Writes to OUT:
- `requirements.txt`: pyproject's `env-server` extra (the server core every env shares), then each env
  folder's own `envs/<name>/requirements.txt` (its dependencies and their pins, beside its code);
- `data/<name>/`: a copy of each env folder that has a data step, `envs/<name>/build_data.py` (run at build
  time as `python build_data.py /opt/env-data/<name>`; its build-only dependencies, kept out of the image, in
  `envs/<name>/data-requirements.txt`).
The install and data layers see only these outputs, so an edit to an env's code rebuilds neither, and a new
env folder needs no line in the Dockerfile. Standard library only (it runs on the plain python image).
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

REQUIREMENTS = "requirements.txt"  # an env's runtime dependencies (pip's format)
DATA_STEP = "build_data.py"  # an env's data step: `python build_data.py DEST`
DATA_REQUIREMENTS = "data-requirements.txt"  # what only its data step needs (pip --target, not in the image)


def env_folders(src: Path) -> list[Path]:
    """The folders under src/envs, sorted (any of them may bring requirements or a data step)."""
    return sorted(p for p in (src / "envs").iterdir() if p.is_dir() and p.name != "__pycache__")


def requirements(src: Path) -> list[str]:
    """The image's pip requirement lines: the server core, then each env folder's, each block headed by its source."""
    core = tomllib.loads((src / "pyproject.toml").read_text())["project"]["optional-dependencies"]["env-server"]
    lines = ["# pyproject.toml [env-server]", *core]
    for folder in env_folders(src):
        reqs = folder / REQUIREMENTS
        if reqs.is_file():
            lines += [f"# envs/{folder.name}/{REQUIREMENTS}", *reqs.read_text().splitlines()]
    return lines


def data_steps(src: Path) -> list[Path]:
    """The env folders with a data step."""
    return [f for f in env_folders(src) if (f / DATA_STEP).is_file()]


def write(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / REQUIREMENTS).write_text("\n".join(requirements(src)) + "\n")
    (out / "data").mkdir(exist_ok=True)  # present even with no data step: the Dockerfile copies it
    for folder in data_steps(src):
        shutil.copytree(folder, out / "data" / folder.name, ignore=shutil.ignore_patterns("__pycache__"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: env_folders.py SRC OUT (SRC holds pyproject.toml and envs/)")
    write(Path(sys.argv[1]), Path(sys.argv[2]))
