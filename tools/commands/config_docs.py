"""Print docs/configuration.md, the `.env` reference, from the typed settings (`--write`: refresh it, and give a
new setting its `.env.example` line and its pass-through in compose.yaml's `x-run-config`; `--check`: exit 1 naming
what is out of date, without writing).

One row per key of .env.example, in its order. The meaning comes from the one class that reads the key: the trainer's
contract.config.RunConfig, else the host's tools.settings.StackEnv, else (keys only Compose reads) COMPOSE_ONLY below.
The default is the value .env.example ships with, else the typed default (what an empty line gives).

A new trainer setting is then written once, as a field of its section in contract/config/ (with its description):
`make config-docs` adds `NAME=` (its description as the comment) to .env.example and `NAME: ${NAME:-}` to
x-run-config, and writes its row here; edit those lines afterwards if it needs a Compose fallback or a shipped value."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from tools.errors import parse_env_file
from tools.settings import ENV_EXAMPLE, ROOT, StackEnv

PAGE = "docs/configuration.md"
COMPOSE = ROOT / "compose.yaml"
RUN_CONFIG_BLOCK = "x-run-config: &run-config\n"  # the trainers' pass-through of every RunConfig field
TRAINERS = ("trainer", "trainer-cpu")  # the services that read RunConfig (x-run-config is merged into both)
# RunConfig fields compose.yaml sets for every run, not users: container paths and service URLs (no .env.example line).
FIXED_BY_COMPOSE = {"OUTPUT_DIR", "VLLM_SERVER_URL", "VLLM_WORLD_SIZE"}  # the last: tools/gpu_layout.py, from VLLM_GPU

# Keys no settings class describes: Compose interpolates them into compose.yaml or the generated env services.
COMPOSE_ONLY = {
    "ENV_ECHO_IMAGE": "image serving the echo env: empty, ours (`<STACK_NAME>/env-server:local`), or an OpenEnv image",
    "ENV_WORDLE_IMAGE": "image serving Wordle",
    "ENV_CATCH_IMAGE": "image serving Catch",
    "ENV_ECHO_REPLICAS": "echo containers (fleet tasks with `ENV_FLEET=swarm`)",
    "ENV_WORDLE_REPLICAS": "Wordle containers",
    "ENV_CATCH_REPLICAS": "Catch containers",
    "ENV_REPLICAS_MAX": "the most containers `ENV_<NAME>_REPLICAS=auto` starts per env",
    "ENV_SESSION_TIMEOUT_S": "idle sessions are closed after this, freeing the slot of a vanished client: this "
    "project's env servers only (upstream images on openenv 0.10 `create_app` ignore it and reap none; their slots free when the "
    "socket closes: the trainer closes its sessions on every way out, and a killed process's close)",
    "ENV_MEM_LIMIT": "memory limit of each env container",
    "ENV_STEP_DELAY_S": "our built-in env servers answer every tool call this many seconds later (without holding up "
    "other sessions): a slow env on purpose, as `make bench-async` uses (0.25)",
    "OPENENV_MODE": "as upstream OpenEnv's servers, ours and any image's: `production` drops HTTP `/reset`, `/step`, "
    "`/state` (the trainer uses `/ws`, or `/mcp` on an HTTP-only image)",
    "ENABLE_WEB_INTERFACE": "`true` adds upstream's Gradio UI at `/web` to every env server (published on 127.0.0.1 "
    "only)",
    "VLLM_IMAGE": "vLLM image; the GPU trainer image is built on the same one (driver table in "
    "[GPU host](gpu-host.md#driver-and-image))",
    "VLLM_SHM_SIZE": "/dev/shm of the vllm container",
    "VLLM_MEM_LIMIT": "memory limit of the vllm container (host memory; its GPU memory is "
    "`VLLM_GPU_MEMORY_UTILIZATION`)",
    "VLLM_PIDS_LIMIT": "processes + threads limit of the vllm container",
    "TRAINER_SHM_SIZE": "/dev/shm of the trainer container",
    "TRAINER_MEM_LIMIT": "memory limit of the GPU trainer container (a backstop against hostile env replies)",
    "TRAINER_CPU_MEM_LIMIT": "memory limit of the CPU trainer and model-init containers",
    "TRAINER_PIDS_LIMIT": "process/thread limit of each trainer container (and model-init)",
    "NCCL_DEBUG": "NCCL log level (`INFO` shows the transport chosen)",
    "NCCL_P2P_DISABLE": "no CUDA P2P (two containers are two hosts to NCCL anyway, unless `NCCL_FAST_PATH=1`)",
    "NCCL_SHM_DISABLE": "no shared-memory transport (likewise)",
    "NCCL_SOCKET_IFNAME": "interface NCCL uses on the compose network; empty: vllm uses `eth0` (its one network), the "
    "trainer, on two, the interface vLLM reaches it on",
    "NCCL_FAST_PATH": "`1`: vllm and trainer look like one host to NCCL, so it may pick P2P/SHM "
    "([Faster NCCL path](gpu-host.md#faster-nccl-path-opt-in))",
    "VLLM_HOST_IP": "the trainer's address for the NCCL rendezvous; empty: resolved on the compose network",
    "WANDB_API_KEY_FILE": "`WANDB_MODE=online`: file holding your W&B API key (a Compose secret), e.g. "
    "`./.secrets/wandb_api_key`",
    "TORCH_INDEX_URL": "where CPU images get torch when no local wheel is found",
    "JUDGE_MEM_LIMIT": "memory limit of the judge container (host memory; its GPU memory is `JUDGE_GPU_MEMORY_SHARE`)",
    "JUDGE_SHM_SIZE": "/dev/shm of the judge container",
}

# Keys whose name holds the env's: any env of ENV_NAME, read by the generated env services (tools/compose_file.py).
PER_ENV = [
    ("ENV_<NAME>_IMAGE", "",
     "the image serving env `<name>`: any OpenEnv server ([Bring your own environment]"
     "(environments.md#bring-your-own-environment))"),
    ("ENV_<NAME>_REPLICAS", "`auto` for an env learned from its image",
     "a number, or `auto`: measure one container, run as many as the run's sessions need"),
    ("ENV_<NAME>_PORT", "the one port its image `EXPOSE`s, else `8000`",
     "the port env `<name>`'s server listens on inside its container (1-65535): where the stack publishes, "
     "health-checks, measures and reaches it; an image exposing several ports gets `8000` and a line naming this"),
    ("ENV_<NAME>_USER", "`10001:10001`", "only for an image that needs root (`0`)"),
    ("ENV_<NAME>_SPLIT", "its train split", "an env that publishes its own tasks (OpenEnv's Task API): the split to "
     "train on, one row per task ([Envs that bring their own tasks](environments.md#envs-that-bring-their-own-tasks))"),
]

HEADER = """# Configuration: every `.env` variable

<!-- Generated by `make config-docs` (python -m tools config-docs --write); a test fails when this page differs. Edit the
descriptions where they live (contract/config/: RunConfig's sections; tools/settings.py StackEnv; tools/commands/config_docs.py
COMPOSE_ONLY), not here. -->

Every training variable is a field of `contract.config.RunConfig` (pydantic-settings), validated
before anything starts; `make doctor` validates `.env` with the same class. A key no setting reads (a typo such as
`LEARNIG_RATE=0.1`, which would leave the default in place) is named by `make doctor` and at the start of `make train`,
with the closest known name; a variable of your own is only warned about, never refused.

The default is the value `.env.example` ships with, else the one an empty line gives.
"""


def shown(value: Any) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        value = str(value).lower()
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def run_fields(config: type | None = None) -> dict[str, Any]:
    """Every trainer setting (.env name -> its field): contract.config.RunConfig's, or `config`'s (tests)."""
    if config is None:
        from contract.config import RunConfig as config
    return {name.upper(): field for name, field in config.model_fields.items()}


def rows(config: type | None = None, example: Path | None = None) -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every key of .env.example, in its order; a key no source describes raises."""
    fields = run_fields(config)
    out = []
    for key, value in parse_env_file(example or ENV_EXAMPLE).items():
        field = fields.get(key) or StackEnv.model_fields.get(key)
        meaning = field.description if field is not None and field.description else COMPOSE_ONLY.get(key)
        if not meaning:
            raise SystemExit(f"{key} in .env.example has no description: give its settings field a description, or "
                             f"add it to COMPOSE_ONLY in tools/commands/config_docs.py")
        default = value or (shown(field.default) if field is not None else "")
        out.append((key, shown(default) if value else default, meaning))
    return out


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def page(config: type | None = None, example: Path | None = None) -> str:
    lines = [HEADER, "| variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {cell(default)} | {cell(meaning)} |" for key, default, meaning in rows(config, example)]
    lines += ["", "## Per-env variables", "", "| variable | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {default} | {meaning} |" for key, default, meaning in PER_ENV]
    return "\n".join(lines) + "\n"


def passed_to_trainers(compose: Path | None = None) -> set[str]:
    """The variables compose.yaml hands both trainer services (x-run-config is merged into each)."""
    import yaml

    services = yaml.safe_load((compose or COMPOSE).read_text())["services"]
    return set.intersection(*(set(services[name].get("environment") or {}) for name in TRAINERS))


def missing(config: type | None = None, example: Path | None = None, compose: Path | None = None) -> dict[str, list[str]]:
    """The trainer settings .env.example and compose.yaml do not carry yet, by file (empty lists: in sync)."""
    names = list(run_fields(config))
    listed, passed = set(parse_env_file(example or ENV_EXAMPLE)), passed_to_trainers(compose)
    return {".env.example": [n for n in names if n not in listed and n not in FIXED_BY_COMPOSE],
            "compose.yaml x-run-config": [n for n in names if n not in passed]}


def add_to_env_example(text: str, names: list[str], fields: dict[str, Any]) -> str:
    """.env.example with `NAME=` (empty: the typed default) after its description, for each of `names`."""
    for name in names:
        comment = textwrap.wrap(fields[name].description or name, 116)
        text = text.rstrip("\n") + "\n" + "".join(f"# {line}\n" for line in comment) + f"{name}=\n"
    return text


def add_to_compose(text: str, names: list[str]) -> str:
    """compose.yaml with `NAME: ${NAME:-}` at the end of x-run-config (unset: empty, the trainer's default)."""
    start = text.index(RUN_CONFIG_BLOCK) + len(RUN_CONFIG_BLOCK)
    entries = 0
    lines = text[start:].split("\n")
    while entries < len(lines) and lines[entries].startswith("  "):  # the block: its indented lines
        entries += 1
    end = start + sum(len(line) + 1 for line in lines[:entries])
    added = "".join(f"  {name}: ${{{name}:-}}\n" for name in names)
    return text[:end] + added + text[end:]


def write(config: type | None = None, root: Path = ROOT) -> list[str]:
    """Bring .env.example, compose.yaml and the page up to date (under `root`); the files it changed."""
    example, compose, doc = root / ".env.example", root / "compose.yaml", root / PAGE
    gaps, fields, changed = missing(config, example, compose), run_fields(config), []
    if gaps[".env.example"]:
        example.write_text(add_to_env_example(example.read_text(), gaps[".env.example"], fields))
        changed.append(".env.example")
    if gaps["compose.yaml x-run-config"]:
        compose.write_text(add_to_compose(compose.read_text(), gaps["compose.yaml x-run-config"]))
        changed.append("compose.yaml")
    text = page(config, example)  # built whole first: a key without a description stops before the page is touched
    if not doc.exists() or doc.read_text() != text:
        doc.write_text(text)
        changed.append(PAGE)
    return changed


def drift(config: type | None = None, root: Path = ROOT) -> list[str]:
    """One line per file out of step with the typed settings (empty: in sync); `--write` fixes them all."""
    example, compose, doc = root / ".env.example", root / "compose.yaml", root / PAGE
    lines = [f"{where} lacks {', '.join(names)}" for where, names in missing(config, example, compose).items() if names]
    if not doc.exists() or doc.read_text() != page(config, example):
        lines.append(f"{PAGE} is not what the settings describe")
    return lines


def run(args: list[str]) -> int:
    if args == ["--write"]:
        changed = write()
        print(f"wrote {', '.join(changed)}" if changed else f"{PAGE}, .env.example and compose.yaml are up to date")
    elif args == ["--check"]:
        lines = drift()
        for line in lines:
            print(f"config-docs: {line}; run `make config-docs` and commit the result")
        return 1 if lines else 0
    elif args:
        print(f"config-docs: unknown arguments {' '.join(args)}; run it bare (print the page), with --write or --check")
        return 2
    else:
        print(page(), end="")
    return 0
