"""Upstream OpenEnv images trained through `.env` alone: one CPU run of 3 steps per env, one table.

    .venv/bin/python bench/upstream_envs.py [--envs connect4_env,snake_env] [--image-format 'openenv-{short}']
                                            [--project-prefix upstream-] [--steps 3] [--json rows.json]

The images are yours to build first, from OpenEnv's repository, as its README says (`openenv build envs/<env>`
tags `openenv-<env without _env>`, the default --image-format); this script builds nothing. Default --envs: every
env that docs/upstream-envs.json classes as needing no outside service (no Hub download at run time, no GPU, no cloud
key, no simulator binary outside PyPI/Debian).

For each env, exactly the user's path: an env file (.env.example plus TRAIN_MODE=cpu, ENV_NAME=<env>,
ENV_<ENV>_IMAGE, MAX_STEPS, COMPOSE_PROJECT_NAME=<prefix><env>; ENV_<ENV>_REPLICAS left at auto), then
`python -m tools train` with STACK_ENV_FILE pointing at it (what `make train` runs). From its output: server healthy,
the transport and tools learned (preflight), steps done and tool calls per episode. Then, against the env's running
container on 127.0.0.1, the share of warm-start demo calls the env accepts (trainer/tiny_model.py's
build_conversations, 20 episodes: a call answered with an error is refused; goal >= 90 %). The stack is taken down
(volumes too) after each env. A failed env gets its first error line. A benchmark, not a test: it prints.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs import naming  # noqa: E402

TABLE = ROOT / "docs" / "upstream-envs.json"
RUN_NAME = "upstream"  # the run's folder in the outputs volume: /outputs/upstream
ACCEPTANCE_GOAL = 0.9
DEMO_EPISODES = 20
ERROR_WORDS = re.compile(r"\b(?:error|failed|cannot|stalled|unhealthy|refused|not an openenv|traceback)\b", re.I)


@dataclass
class Row:
    env: str
    image: str
    image_found: bool = False
    healthy: bool = False
    transport: str = ""
    tools: str = ""
    acceptance: float | None = None
    steps: int = 0
    tool_calls: float = 0.0
    tool_failures: float | None = None  # failed calls per call, over the run's steps (82 % on snake_env once)
    wall_s: float = 0.0
    error: str = ""

    @property
    def result(self) -> str:
        ok = self.steps > 0 and self.tool_calls > 0 and (self.acceptance or 0) >= ACCEPTANCE_GOAL
        return "ok" if ok else "fail"


def no_outside_service() -> list[str]:
    return [r["env"] for r in json.loads(TABLE.read_text())["envs"] if r["class"] == "none"]


def env_name(upstream: str) -> str:
    """The name in ENV_NAME: upstream's folder (echo_env), never one of ours (echo)."""
    return upstream.lower()


def env_file(path: Path, name: str, image: str, project: str, steps: int, **more: str) -> Path:
    """.env.example as a user copies it, with the lines a user edits appended (a later line wins)."""
    lines = {"COMPOSE_PROJECT_NAME": project, "TRAIN_MODE": "cpu", "ENV_NAME": name, naming.image_var(name): image,
             "MAX_STEPS": str(steps), "RUN_NAME": RUN_NAME, **more}
    path.write_text((ROOT / ".env.example").read_text() + "\n" + "".join(f"{k}={v}\n" for k, v in lines.items()))
    return path


def stack(envfile: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("TRAIN_MODE", "ENV_NAME", "COMPOSE_PROFILES")}
    env["STACK_ENV_FILE"] = str(envfile)
    try:
        return subprocess.run([sys.executable, "-m", "tools", *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return subprocess.CompletedProcess(exc.cmd, 124, out, f"timed out after {timeout:.0f} s")


def parse_train(row: Row, out: str) -> None:
    """Fill `row` from `python -m tools train`'s output (its one-line messages, tools/ and trainer/run/)."""
    row.healthy = bool(re.search(r"Container \S+-env-\S+\s+Healthy", out)) or "replica(s) healthy" in out
    if m := re.search(rf"\[preflight\] ok: env {re.escape(row.env)}: .*?transport (\S+)", out):
        row.transport = m.group(1)
    if m := re.search(rf"\[preflight\] ok: env {re.escape(row.env)}: learned from the server \(([^)]*)\): tools (.*)",
                      out):
        row.tools = f"{m.group(1)}: {m.group(2).strip()}"
    steps = [int(s) for s in re.findall(r"\[train\] step (\d+)/\d+", out)]
    row.steps = max(steps, default=0)
    if m := re.search(r"\[train\] done: .*tool calls/episode ([0-9.]+)(?:, tool failures ([0-9.]+))?", out):
        row.tool_calls = float(m.group(1))
        row.tool_failures = float(m.group(2)) if m.group(2) else None


def first_error(out: str) -> str:
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if ERROR_WORDS.search(line) and not line.startswith(("#", "[preflight] ok", "time=")):
            detail = f" {lines[i + 1]}" if line.endswith(":") and i + 1 < len(lines) else ""  # `[preflight] FAILED:`
            return (line + detail)[:300]
    return lines[-1][:300] if lines else ""


def env_url(envfile: Path, name: str) -> str | None:
    """The env's first container on 127.0.0.1: each publishes its server's one port (8000, or ENV_<NAME>_PORT, or
    its image's EXPOSE: tools/env_ports.py) on an ephemeral loopback port."""
    res = stack(envfile, "compose", "ps", "--format", "json", naming.service_name(name), timeout=60)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.strip().startswith("{")]
    published = [p["PublishedPort"] for row in rows for p in row.get("Publishers") or [] if p.get("PublishedPort")]
    return f"http://127.0.0.1:{published[0]}" if res.returncode == 0 and published else None


def acceptance(name: str, url: str) -> tuple[float | None, str]:
    """Share of the warm-start's demo calls the env accepts: the same episodes the CPU profile's model-init job plays
    (trainer/tiny_model.py build_conversations), a tool result that is `{"error": ...}` counting as refused. A call
    the env refused is drawn again there (up to REDRAWS times); how many draws were replaced is printed."""
    from envs.generic import GenericSpec
    from trainer.tiny_model import build_conversations, is_refusal

    try:
        spec = GenericSpec.discover(name, url)
        demos = build_conversations(name, spec, url, DEMO_EPISODES, 0)
    except Exception as exc:  # noqa: BLE001 - a row of the table, not a crash of the bench
        return None, f"demo calls: {type(exc).__name__}: {str(exc)[:200]}"
    results = [m["content"] for d in demos for m in d.messages if m["role"] == "tool"]
    refused = [r for r in results if is_refusal(r)]
    if not results:
        return None, "demo calls: none made"
    why = f"first refusal: {refused[0][:200]}" if refused else ""
    redrawn = sum(d.refused_draws for d in demos)
    if redrawn:  # refused draws the warm-start replaced: the schema left the call's shape open
        print(f"[bench-upstream] {name}: {redrawn} of {redrawn + len(results)} demo-call draws refused and drawn "
              f"again", flush=True)
    return 1 - len(refused) / len(results), why


def image_found(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0


def run_env(upstream: str, image: str, project: str, steps: int, timeout: float, workdir: Path) -> Row:
    name = env_name(upstream)
    row = Row(upstream, image)
    t0 = time.monotonic()
    row.image_found = image_found(image)
    if not row.image_found:
        row.error = f"image {image} is not on this machine: build it from OpenEnv's repository first"
        return row
    envfile = env_file(workdir / f"{project}.env", name, image, project, steps)
    try:
        res = stack(envfile, "train", timeout=timeout)
        out = res.stdout + "\n" + res.stderr
        (workdir / f"{project}.log").write_text(out)
        parse_train(row, out)
        if res.returncode != 0:
            row.error = first_error(out)
        url = env_url(envfile, name)
        if url:
            row.acceptance, why = acceptance(name, url)
            if why and not row.error and (row.acceptance or 0) < ACCEPTANCE_GOAL:
                row.error = why
    finally:
        stack(envfile, "compose", "--profile", "*", "down", "--volumes", "--remove-orphans", timeout=300)
        row.wall_s = round(time.monotonic() - t0, 1)
    return row


def table(rows: list[Row]) -> str:
    head = ("env", "image", "healthy", "transport", "tools", "accepted", "steps", "calls/ep", "failed calls", "wall s",
            "result", "first error")
    lines = [" | ".join(head)]
    for r in rows:
        share = "-" if r.acceptance is None else f"{r.acceptance:.0%}"
        lines.append(" | ".join(str(c) for c in (
            r.env, r.image if r.image_found else f"{r.image} (missing)", "yes" if r.healthy else "no",
            r.transport or "-", r.tools or "-", share, r.steps, f"{r.tool_calls:.2f}",
            "-" if r.tool_failures is None else f"{r.tool_failures:.0%}", f"{r.wall_s:.0f}", r.result,
            r.error or "")))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", default=None, help="upstream env folders, comma-separated (default: every env of "
                                                "docs/upstream-envs.json that needs no outside service)")
    p.add_argument("--image-format", default="openenv-{short}",
                   help="the image of an env: {env} is its folder (echo_env), {short} without _env (echo); "
                        "default openenv-{short}, what `openenv build` tags")
    p.add_argument("--project-prefix", default="upstream-", help="compose project of an env: <prefix><env>")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for one env's `train` (default 1800)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--logs", type=Path, default=None, help="keep each env's env file and `train` output here")
    args = p.parse_args()
    envs = [e.strip() for e in args.envs.split(",") if e.strip()] if args.envs else no_outside_service()
    for e in envs:
        if not re.fullmatch(naming.NAME_PATTERN, env_name(e)):
            sys.exit(f"--envs: {e!r} is not an env name ({naming.NAME_PATTERN}); name upstream's folder, e.g. echo_env")
    rows = []
    with tempfile.TemporaryDirectory(prefix="upstream-envs-") as tmp:
        workdir = args.logs or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for e in envs:
            image = args.image_format.format(env=e, short=e.removesuffix("_env"))
            row = run_env(e, image, f"{args.project_prefix}{e}", args.steps, args.timeout, workdir)
            share = "-" if row.acceptance is None else f"{row.acceptance:.0%}"
            print(f"{e}: {row.result} ({row.wall_s:.0f} s; {row.steps} steps, {row.tool_calls:.2f} tool calls/episode, "
                  f"demo calls accepted {share}){' - ' + row.error if row.error else ''}", flush=True)
            rows.append(row)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "result": r.result} for r in rows], indent=1))


if __name__ == "__main__":
    main()
