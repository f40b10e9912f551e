"""The layers ARCHITECTURE.md draws: the host (tools/) and the trainer (trainer/) are siblings over the shared rules
(contract/), which import no ML library, over envs/, which imports none of them; inside trainer/, its sub-packages on
floors that import only down, and inside tools/, its modules. Read from every import statement, those inside functions
and under `if TYPE_CHECKING:` too (an import for a type hint is an arrow like any other)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# trainer/'s floors, top first: a module imports its own package and packages on lower floors only; packages on one
# floor do not import each other. The entrypoints (trainer/*.py, `python -m trainer.X`) are the top floor, under
# gpu_selfcheck/ (`python -m trainer.gpu_selfcheck`, an entrypoint big enough to be a package: it uses tiny_model.py).
TRAINER_FLOORS = [("gpu_selfcheck",), ("*.py",), ("after",), ("run",), ("async_grpo",), ("judge",), ("gpu", "rollouts"),
                  ("core", "modeling")]
# tools/'s floors, top first, by module (commands/ is one unit): the same rule.
TOOLS_FLOORS = [("__main__",), ("cli",), ("commands",), ("fleet",), ("prepare",), ("plan",), ("docker_host", "rehearsal", "judge"),
                ("compose_file", "derive", "nccl_check"), ("env_replicas", "gpu_doctor"),
                ("env_ports", "gpu_layout", "images", "env_keys"), ("env_kinds", "settings"),
                ("errors", "host_python", "venv_install", "proxies")]
FLOORS = {"trainer": TRAINER_FLOORS, "tools": TOOLS_FLOORS}
ML_LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "vllm", "datasets", "bitsandbytes", "deepspeed")


def imported_modules(folder: str) -> list[tuple[str, int, str]]:
    """(file, line, module) for every import under `folder`: `import a.b`, `from a.b import c` (as a.b and a.b.c),
    and importlib.import_module / __import__ of a literal name."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                found += [(rel, node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((rel, node.lineno, node.module))
                found += [(rel, node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
            elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                  and isinstance(node.args[0].value, str)
                  and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")):
                found.append((rel, node.lineno, node.args[0].value))
    return found


def offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted({f"{file}:{line} imports {module}" for file, line, module in imported_modules(folder)
                   if module.split(".")[0] in forbidden})


def unit_of(package: str, module: str, floors: list[tuple[str, ...]]) -> str | None:
    """The floor unit of a module under `package`: its sub-package, a module the floors name, else "*.py" (a module at
    the package's root that the floors do not name: trainer/'s entrypoints)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != package:
        return None
    named = {unit for units in floors for unit in units}
    return parts[1] if (ROOT / package / parts[1]).is_dir() or parts[1] in named else "*.py"


def imports_running_up(package: str = "trainer", floors: list[tuple[str, ...]] | None = None) -> list[str]:
    """Every import in `package` of a unit not on a lower floor than the importer's (its own unit excepted)."""
    floors = floors or FLOORS[package]
    floor_of = {unit: n for n, units in enumerate(floors) for unit in units}
    imports = imported_modules(package)
    named = {(file, line, module) for file, line, module in imports}
    found = set()
    for file, line, module in imports:
        here = unit_of(package, ".".join(Path(file).with_suffix("").parts), floors)
        there = unit_of(package, module, floors)
        if there is None or there == here or floor_of.get(there, -1) > floor_of.get(here, -1):
            continue
        if any(f == file and n == line and m.startswith(module + ".") for f, n, m in named):
            continue  # `from a.b import c`: named once, as a.b.c
        found.add(f"{file}:{line} imports {module}, which runs up from {here} to {there} (tests/test_layers.py "
                  f"{package.upper()}_FLOORS: move the code down or the import up)")
    return sorted(found)


def test_the_host_imports_nothing_from_the_trainer():
    assert offenders("tools", ("trainer",)) == []


def test_the_trainer_imports_nothing_from_the_host():
    assert offenders("trainer", ("tools",)) == []


def test_envs_import_nothing_above_them():
    # the env servers' image ships envs/ alone; contract/ and both sides import envs/, never the other way
    assert offenders("envs", ("trainer", "tools", "contract", "bench")) == []


def test_the_contract_imports_neither_side():
    assert offenders("contract", ("trainer", "tools", "bench")) == []


def test_the_contract_imports_no_ml_library_anywhere_in_its_code():
    assert offenders("contract", ML_LIBRARIES) == []


@pytest.mark.parametrize("folder", ["contract", "tools"])
def test_importing_every_module_loads_no_ml_library(folder):
    # indirect imports too: whatever contract/ (or the host) imports from envs/ must stay light
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in sorted((ROOT / folder).rglob("*.py")) if p.name != "__main__.py"]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {ML_LIBRARIES!r})\nassert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_scan_sees_imports_inside_functions(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("def f():\n    import torch\n    from trainer import train\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert offenders("pkg", ML_LIBRARIES + ("trainer",)) == ["pkg/m.py:2 imports torch", "pkg/m.py:3 imports trainer",
                                                             "pkg/m.py:3 imports trainer.train"]


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_each_floor_imports_only_down(package):
    assert imports_running_up(package) == []


def test_every_trainer_sub_package_has_a_floor():
    packages = {p.parent.name for p in (ROOT / "trainer").glob("*/__init__.py")}
    assert packages == {unit for units in TRAINER_FLOORS for unit in units} - {"*.py"}, \
        "a new trainer/ sub-package: give it a floor in TRAINER_FLOORS (and ARCHITECTURE.md's picture)"


def test_every_tools_module_has_a_floor():
    units = {p.stem for p in (ROOT / "tools").glob("*.py") if p.stem != "__init__"}
    units |= {p.parent.name for p in (ROOT / "tools").glob("*/__init__.py")}
    assert units == {unit for units in TOOLS_FLOORS for unit in units}, \
        "a new tools/ module: give it a floor in TOOLS_FLOORS (and tools/__init__.py's, ARCHITECTURE.md's picture)"


def test_the_trainer_scan_names_an_import_running_up(tmp_path, monkeypatch):
    for folder, text in {"low": "import os\n", "high": "from trainer.low import x\n", "": "from trainer import high\n"}.items():
        (tmp_path / "trainer" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "trainer" / folder / ("__init__.py" if folder else "main.py")).write_text(text)
    (tmp_path / "trainer" / "low" / "m.py").write_text("def f():\n    from trainer.high import y\n    import trainer.main\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = imports_running_up("trainer", [("*.py",), ("high",), ("low",)])
    assert [line.split(", which")[0] for line in found] == [
        "trainer/low/m.py:2 imports trainer.high.y", "trainer/low/m.py:3 imports trainer.main"]
    assert found[0].endswith("runs up from low to high (tests/test_layers.py TRAINER_FLOORS: move the code down or "
                             "the import up)")


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_circles(package: str) -> list[list[str]]:
    """The import circles among `package`'s modules (each module's imports of the others, as imported_modules reads
    them; `from a.b import c` is an arrow to a.b.c where that is a module): every strongly connected set of two or
    more, sorted."""
    modules = {module_of(p) for p in (ROOT / package).rglob("*.py")}
    by_line: dict[tuple[str, int], set[str]] = {}
    for file, line, name in imported_modules(package):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            by_line.setdefault((module_of(ROOT / file), line), set()).add(name)
    arrows: dict[str, set[str]] = {m: set() for m in modules}
    for (here, _), names in by_line.items():
        arrows[here] |= {n for n in names if n != here and not any(o.startswith(n + ".") for o in names)}
    reach = {m: set() for m in modules}  # who each module reaches, transitively (the packages are small)
    for m in modules:
        todo = list(arrows[m])
        while todo:
            n = todo.pop()
            if n not in reach[m]:
                reach[m].add(n)
                todo += arrows[n]
    circles = {tuple(sorted({m} | {n for n in reach[m] if m in reach[n]})) for m in modules if m in reach[m]}
    return sorted(list(c) for c in circles)


@pytest.mark.parametrize("package", ["tools", "trainer", "contract", "envs"])
def test_no_import_circles(package):
    assert import_circles(package) == [], "an import circle: move what both need down, into a module of its own"


def test_the_circle_scan_sees_a_type_hint_import(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")  # b, the module: not a circle through pkg
    (tmp_path / "pkg" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n")
    (tmp_path / "pkg" / "c.py").write_text("def f():\n    import pkg.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_circles("pkg") == [["pkg.a", "pkg.b", "pkg.c"]]


@pytest.mark.parametrize("dockerfile", ["services/trainer/Dockerfile", "services/trainer/Dockerfile.cpu"])
def test_every_trainer_image_ships_the_contract(dockerfile):
    text = (ROOT / dockerfile).read_text()
    assert "COPY contract/ /app/contract/" in text and "COPY trainer/ /app/trainer/" in text


MAX_SOURCE_LINES = 600  # a file past this does several things: split it by concern (as bench/chaos*.py)


def test_no_source_file_is_over_600_lines():
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.sh", "Makefile", "Dockerfile*", "*/Dockerfile*"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    long = [f"{name}: {n} lines" for name in tracked
            if (ROOT / name).is_file() and (n := len((ROOT / name).read_text().splitlines())) > MAX_SOURCE_LINES]
    assert long == [], f"over {MAX_SOURCE_LINES} lines, split by concern: {long}"
