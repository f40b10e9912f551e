"""The layers ARCHITECTURE.md draws: the host (tools/) and the trainer (trainer/) are siblings over the shared rules
(contract/), which import no ML library. Read from every import statement, those inside functions too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("dockerfile", ["services/trainer/Dockerfile", "services/trainer/Dockerfile.cpu"])
def test_every_trainer_image_ships_the_contract(dockerfile):
    text = (ROOT / dockerfile).read_text()
    assert "COPY contract/ /app/contract/" in text and "COPY trainer/ /app/trainer/" in text
