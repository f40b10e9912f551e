"""The layers ARCHITECTURE.md draws: the host (tools/) and the trainer (trainer/) are siblings over the shared rules
(contract/), which import no ML library; inside trainer/, its sub-packages on floors that import only down.
Read from every import statement, those inside functions too."""

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
TRAINER_FLOORS = [("gpu_selfcheck",), ("*.py",), ("after",), ("run",), ("async_grpo",), ("gpu", "rollouts"),
                  ("core", "modeling")]
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


def trainer_unit(module: str) -> str | None:
    """The floor unit of a module under trainer/: its sub-package, or "*.py" for a module at trainer/'s root."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "trainer":
        return None
    return parts[1] if (ROOT / "trainer" / parts[1]).is_dir() else "*.py"


def imports_running_up(floors: list[tuple[str, ...]] = TRAINER_FLOORS) -> list[str]:
    """Every import in trainer/ of a unit not on a lower floor than the importer's (its own unit excepted)."""
    floor_of = {unit: n for n, units in enumerate(floors) for unit in units}
    imports = imported_modules("trainer")
    named = {(file, line, module) for file, line, module in imports}
    found = set()
    for file, line, module in imports:
        here, there = trainer_unit(".".join(Path(file).with_suffix("").parts)), trainer_unit(module)
        if there is None or there == here or floor_of.get(there, -1) > floor_of.get(here, -1):
            continue
        if any(f == file and n == line and m.startswith(module + ".") for f, n, m in named):
            continue  # `from a.b import c`: named once, as a.b.c
        found.add(f"{file}:{line} imports {module}, which runs up from {here} to {there} (tests/test_layers.py "
                  f"TRAINER_FLOORS: move the code down or the import up)")
    return sorted(found)


def test_the_host_imports_nothing_from_the_trainer():
    assert offenders("tools", ("trainer",)) == []


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


def test_trainer_sub_packages_import_only_down():
    assert imports_running_up() == []


def test_every_trainer_sub_package_has_a_floor():
    packages = {p.parent.name for p in (ROOT / "trainer").glob("*/__init__.py")}
    assert packages == {unit for units in TRAINER_FLOORS for unit in units} - {"*.py"}, \
        "a new trainer/ sub-package: give it a floor in TRAINER_FLOORS (and ARCHITECTURE.md's picture)"


def test_the_trainer_scan_names_an_import_running_up(tmp_path, monkeypatch):
    for folder, text in {"low": "import os\n", "high": "from trainer.low import x\n", "": "from trainer import high\n"}.items():
        (tmp_path / "trainer" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "trainer" / folder / ("__init__.py" if folder else "main.py")).write_text(text)
    (tmp_path / "trainer" / "low" / "m.py").write_text("def f():\n    from trainer.high import y\n    import trainer.main\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = imports_running_up([("*.py",), ("high",), ("low",)])
    assert [line.split(", which")[0] for line in found] == [
        "trainer/low/m.py:2 imports trainer.high.y", "trainer/low/m.py:3 imports trainer.main"]
    assert found[0].endswith("runs up from low to high (tests/test_layers.py TRAINER_FLOORS: move the code down or "
                             "the import up)")


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
