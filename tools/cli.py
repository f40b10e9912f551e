"""`python -m tools COMMAND [ARGS]` (what the Makefile runs): COMMAND is a module in tools/commands/, whose
`run(args)` returns the exit code. With no or an unknown command, the list of commands and what each does."""

from __future__ import annotations

from tools import commands
from tools.errors import StackError, report_stack_error


def usage() -> str:
    lines = ["usage: python -m tools COMMAND [ARGS]", "", "commands:"]
    for name in commands.names():
        doc = (commands.load(name).__doc__ or "").strip().splitlines()
        lines.append(f"  {name:<11} {doc[0] if doc else ''}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    module = commands.load(argv[0]) if argv else None
    if module is None:
        print(usage())
        return 2
    try:
        return module.run(argv[1:])
    except StackError as exc:  # the one place a host error is printed (once) and turned into exit 2
        return report_stack_error(exc)
