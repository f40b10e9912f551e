"""An ORS (OpenReward) env imported with OpenEnv's CLI, built as the import lays it out, trained 3 CPU steps through
`.env` alone: what a new user does, timed, one report.

    .venv/bin/python bench/ors_image.py [--source tests/fixtures/envs/ors_arith/source] [--name ors_arith]
                                        [--image ors-arith-env:local] [--project ors-image] [--steps 3] [--logs DIR]

1. `openenv import <source> --name <name> --type ors` (the real CLI, openenv 0.10.0) into a temporary folder.
2. One line of what it wrote is changed, the smallest change that builds: its pyproject.toml says
   `requires-python = ">=3.10"` (the CLI's template) while openreward 0.1.167 requires Python>=3.11, so the
   Dockerfile's `uv sync` (a universal resolution, every Python the project allows) finds no solution; it becomes
   ">=3.11", as uv's own hint says. tests/envs/test_ors_import.py records both facts.
3. Its server/Dockerfile starts FROM ghcr.io/huggingface/openenv-base:latest, which no registry here serves: when that
   name is not on this machine, bench/openenv_base/Dockerfile (a stand-in: Debian bookworm, Python 3.11, uv 0.5.27
   from PyPI, EXPOSE 8000) is built under it. The import's Dockerfile is built unchanged by Compose (BuildKit: it uses
   `RUN --mount=type=cache`; the docker CLI here has no buildx).
4. An env file (.env.example plus TRAIN_MODE=cpu, ENV_NAME=<name>, ENV_<NAME>_IMAGE, MAX_STEPS, TRACE_EVERY=1,
   COMPOSE_PROJECT_NAME; replicas left at auto), then `python -m tools train` (what `make train` runs); from its
   output and the run's rollouts.jsonl and metrics.jsonl: the Task API splits preflight found, tool calls per episode,
   the rewards the env gave, and whether each traced user message is its task's problem with no `solution` in it. The
   stack is taken down (volumes too) at the end. A benchmark, not a test: it prints.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import upstream_envs as up  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "envs" / "ors_arith" / "source"
BASE_IMAGE = "ghcr.io/huggingface/openenv-base:latest"  # the import's Dockerfile: ARG BASE_IMAGE=...
STAND_IN = ROOT / "bench" / "openenv_base"
TEMPLATE_PYTHON, SDK_PYTHON = 'requires-python = ">=3.10"', 'requires-python = ">=3.11"'


def run(cmd: list[str], what: str, **kw) -> float:
    """Run `cmd`, exit with its last lines when it fails; the seconds it took."""
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        sys.exit(f"[bench-ors] {what} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return time.monotonic() - t0


def import_env(source: Path, name: str, out: Path) -> Path:
    secs = run([sys.executable, "-m", "openenv.cli", "import", str(source), "--name", name, "--output-dir", str(out),
                "--type", "ors"], "openenv import")
    package = out / name
    pyproject = package / "pyproject.toml"
    text = pyproject.read_text()
    if TEMPLATE_PYTHON in text:  # step 2 of the docstring
        pyproject.write_text(text.replace(TEMPLATE_PYTHON, SDK_PYTHON))
        print(f"[bench-ors] pyproject.toml: {TEMPLATE_PYTHON} -> {SDK_PYTHON} (openreward requires Python>=3.11)")
    print(f"[bench-ors] openenv import --type ors: {package} ({secs:.1f} s)", flush=True)
    return package


def base_image() -> None:
    if up.image_found(BASE_IMAGE):
        print(f"[bench-ors] {BASE_IMAGE}: on this machine, used as it is")
        return
    secs = run(["docker", "build", "-q", "-t", BASE_IMAGE, str(STAND_IN)], "building the openenv-base stand-in",
               env=dict(os.environ, DOCKER_BUILDKIT="0"))
    print(f"[bench-ors] {BASE_IMAGE}: built from bench/openenv_base/Dockerfile ({secs:.0f} s)", flush=True)


def build(package: Path, name: str, image: str, project: str) -> None:
    """The import's own server/Dockerfile, its folder the context (as `openenv build` takes it), through Compose."""
    compose = package.parent / "build.yaml"
    compose.write_text(json.dumps({"services": {name: {"image": image, "build": {
        "context": str(package), "dockerfile": "server/Dockerfile"}}}}))
    secs = run(["docker", "compose", "-f", str(compose), "-p", f"{project}-build", "build"], "building the image")
    size = subprocess.run(["docker", "image", "inspect", image, "--format", "{{.Size}}"], capture_output=True,
                          text=True).stdout.strip()
    print(f"[bench-ors] {image}: built from {name}/server/Dockerfile ({secs:.0f} s, {int(size or 0) / 1e6:.0f} MB)",
          flush=True)


def read(envfile: Path, path: str) -> list[dict]:
    res = up.stack(envfile, "compose", "run", "--rm", "--no-deps", "--entrypoint", "cat", "trainer-cpu", path,
                   timeout=300)
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def tasks_of(source: Path) -> dict[str, list[dict]]:
    found = importlib.util.spec_from_file_location("ors_source", source / "server.py")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    env = next(v for v in vars(module).values() if isinstance(v, type) and hasattr(v, "list_tasks")
               and v.__module__ == module.__name__)
    return {split: env.list_tasks(split) for split in env.list_splits()}


def report(out: str, rollouts: list[dict], steps: list[dict], tasks: dict[str, list[dict]]) -> None:
    for line in out.splitlines():
        if re.search(r"Task API|submitted through|\[train\] (step|done)", line):
            print("  " + line.strip())
    shown, leaked = 0, 0
    for row in rollouts:
        kwargs = row["reset"]["reset_kwargs"]
        task = tasks[kwargs["split"]][kwargs["index"]]
        user = [m for m in row["prompt"] if m["role"] == "user"][-1]["content"]
        shown += user.strip().endswith(task["problem"])
        leaked += "solution" in user
    calls = [len(r["tool_calls"]) for r in rollouts]  # the stack's submissions of a plain-text answer included
    print(f"[bench-ors] traced episodes {len(rollouts)}: tasks {sorted({json.dumps(r['reset']['reset_kwargs']) for r in rollouts})}; "
          f"user message = the task's problem {shown}/{len(rollouts)}, with 'solution' in it {leaked}; traced tool "
          f"calls per episode (the stack's submissions included) {sum(calls) / max(len(calls), 1):.2f}; env rewards {[r['env_reward'] for r in rollouts]}")
    print("[bench-ors] steps: " + "; ".join(
        f"{r['step']}: tool calls/episode {r.get('tools/call_frequency', 0):.2f}, reward {r.get('reward', 0):.3f}"
        for r in steps))
    if rollouts:
        print("[bench-ors] first traced episode: " + json.dumps(rollouts[0])[:1500])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", type=Path, default=FIXTURE, help="an ORS env's folder (server.py, requirements.txt)")
    p.add_argument("--name", default="ors_arith")
    p.add_argument("--image", default="ors-arith-env:local")
    p.add_argument("--project", default="ors-image", help="the compose project of the run")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for `train` (default 1800)")
    p.add_argument("--logs", type=Path, default=None, help="keep the import, env file and `train` output here")
    args = p.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ors-image-") as tmp:
        workdir = args.logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        package = import_env(args.source, args.name, workdir / "imported")
        base_image()
        build(package, args.name, args.image, args.project)
        envfile = up.env_file(workdir / f"{args.project}.env", args.name, args.image, args.project, args.steps,
                              TRACE_EVERY="1")
        t_train = time.monotonic()
        try:
            res = up.stack(envfile, "train", timeout=args.timeout)
            train_s = time.monotonic() - t_train
            out = res.stdout + "\n" + res.stderr
            (workdir / f"{args.project}.log").write_text(out)
            row = up.Row(args.name, args.image, image_found=True)
            up.parse_train(row, out)
            print(f"[bench-ors] make train: exit {res.returncode}, {train_s:.0f} s, {row.steps} steps, "
                  f"{row.tool_calls:.2f} tool calls/episode, tool failures {row.tool_failures}, transport "
                  f"{row.transport or '-'}, tools {row.tools or '-'}"
                  f"{'' if res.returncode == 0 else ' - ' + up.first_error(out)}", flush=True)
            rollouts = read(envfile, f"/outputs/{up.RUN_NAME}/rollouts.jsonl")
            steps = [r for r in read(envfile, f"/outputs/{up.RUN_NAME}/metrics.jsonl") if r.get("kind") == "step"]
            report(out, rollouts, steps, tasks_of(args.source))
        finally:
            up.stack(envfile, "compose", "--profile", "*", "down", "--volumes", "--remove-orphans", timeout=300)
    print(f"[bench-ors] {time.monotonic() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
