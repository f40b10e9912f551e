"""What every host module shares at the bottom: the one error type, the one log line, the .env parser."""

from __future__ import annotations

import sys
from pathlib import Path


class StackError(Exception):
    """One clear message naming the fix. Raising it prints nothing: the entry point (tools/cli.py) prints the
    message once and exits 2, and a caller that handles it (doctor's rows) shows it its own way."""

    EXIT_CODE = 2

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


def report_stack_error(exc: StackError) -> int:
    """An entry point's one line for a StackError on stderr; the exit code."""
    print(f"error: {exc}", file=sys.stderr)
    return StackError.EXIT_CODE


def say(msg: str) -> None:
    print(f"[stack] {msg}", flush=True)


def parse_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as Compose reads them (python-dotenv's parser); a malformed line is named."""
    from dotenv.parser import parse_stream

    values: dict[str, str] = {}
    with path.open() as stream:
        for binding in parse_stream(stream):
            if binding.error or (binding.key is not None and binding.value is None):
                raw = binding.original.string.rstrip("\n")
                raise StackError(f"{path.name} line {binding.original.line}: expected KEY=VALUE, got {raw!r}; "
                                 "fix or delete that line")
            if binding.key is not None:
                values[binding.key] = binding.value
    return values
