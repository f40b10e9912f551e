"""The host commands, one module each: `python -m tools NAME [ARGS]` runs tools/commands/<name>.py's `run(rest)`
(a dash in NAME is an underscore in the file name). A module's docstring's first line is its help line.
A new host command is one file here plus its Makefile target."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def names() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def load(name: str) -> ModuleType | None:
    if name not in names():
        return None
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
