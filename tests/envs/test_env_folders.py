"""A new env is one folder: its dependencies (envs/<name>/requirements.txt) and data step (envs/<name>/build_data.py)
sit beside its code, and the env-server image build picks every folder's up with no line naming the env
(services/env-server/Dockerfile through env_folders.py), and the registry finds it by the ENV its __init__.py declares,
checked when the registry is imported (a half-made folder stops the import with one line naming it).
Host-level: reads the files; the image build itself is checked by the container tests."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from envs import registry
from envs.core import DATA_ROOT

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "services/env-server/Dockerfile"


def _env_folders_script():
    spec = importlib.util.spec_from_file_location("env_folders", ROOT / "services/env-server/env_folders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirement_name(line: str) -> str:
    return re.split(r"[\[<>=!~ ;]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _lines(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_every_env_folders_dependencies_and_data_step_are_picked_up(tmp_path):
    script = _env_folders_script()
    script.write(ROOT, tmp_path)
    installed = _lines(tmp_path / "requirements.txt")
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["env-server"]
    assert installed[:len(core)] == core
    folders = [p for p in (ROOT / "envs").iterdir() if p.is_dir() and p.name != "__pycache__"]
    with_reqs = [f for f in folders if (f / "requirements.txt").is_file()]
    with_data = sorted(f.name for f in folders if (f / "build_data.py").is_file())
    assert {"wordle", "catch"} <= {f.name for f in with_reqs} and "wordle" in with_data  # today's, at least
    for folder in with_reqs:
        assert set(_lines(folder / "requirements.txt")) <= set(installed), folder.name
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == with_data
    for name in with_data:  # the whole folder: a data step may read its env's other files (wordle's words.py)
        assert (tmp_path / "data" / name / "build_data.py").is_file()
        assert {p.name for p in (ROOT / "envs" / name).glob("*.py")} <= {p.name for p in (tmp_path / "data" / name).iterdir()}


def test_each_pin_has_one_place():
    script = _env_folders_script()
    names = [_requirement_name(ln) for ln in script.requirements(ROOT) if ln.strip() and not ln.startswith("#")]
    assert len(names) == len(set(names)), f"a requirement listed twice: {sorted(n for n in names if names.count(n) > 1)}"
    data_only = [_requirement_name(ln) for f in (ROOT / "envs").glob("*/data-requirements.txt") for ln in _lines(f)]
    assert data_only and not set(data_only) & set(names)  # build-only: never in the image's venv


def test_the_shared_dockerfile_names_no_env_and_keeps_deps_before_code():
    text = DOCKERFILE.read_text()
    for name in registry.names():
        assert not re.search(rf"\b{name}\b", text, re.I), f"the shared Dockerfile names the env {name!r}"
    assert not re.search(r"envs/[a-z_]", text), "the shared Dockerfile copies one env's files: read them generically"
    assert "services/env-server/env_folders.py" in text
    stages = re.split(r"^FROM ", text, flags=re.M)
    venv = next(s for s in stages if " AS venv" in s.splitlines()[0])
    data = next(s for s in stages if " AS env-data" in s.splitlines()[0])
    runtime = stages[-1]
    # the install and data layers see only env_folders.py's outputs, not the code: a code edit rebuilds neither
    assert "COPY envs/" not in venv + data and "/out/requirements.txt" in venv and "/out/data/" in data
    assert f"{DATA_ROOT}/$name" in data and f"COPY --from=env-data {DATA_ROOT} {DATA_ROOT}" in runtime
    assert runtime.index("COPY --from=venv") < runtime.index("COPY envs/ /app/envs/") < runtime.index("USER 10001")


def test_the_host_venv_installs_the_env_folders_too():
    make = (ROOT / "Makefile").read_text()
    assert "ENV_REQS := $(sort $(wildcard envs/*/requirements.txt))" in make
    assert re.search(r"-e '\.\[test,trainer,env-server\]' \$\(addprefix -r ,\$\(ENV_REQS\)\)", make)


def _envs_copy(tmp_path: Path) -> Path:
    """A checkout's envs/ copied under tmp_path (its code, not its caches), to add or break a folder in."""
    shutil.copytree(ROOT / "envs", tmp_path / "envs", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "envs"


def _import_registry(tmp_path: Path, code: str = "") -> subprocess.CompletedProcess:
    """`import envs.registry` (then `code`) in a fresh interpreter that finds the copy's envs/ first."""
    return subprocess.run([sys.executable, "-c", f"import envs.registry as r\n{code}"], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)})


def test_a_new_env_folder_is_found_with_nothing_else(tmp_path):
    envs = _envs_copy(tmp_path)
    shutil.copytree(envs / "echo", envs / "parrot")  # a new env: its folder (its ENV's paths are the folder's)
    out = _import_registry(tmp_path, "print(r.__file__, ','.join(r.names()), r.get('parrot').tool_class_path)")
    assert out.returncode == 0, out.stderr
    where, names, tool = out.stdout.split()
    assert where == str(envs / "registry.py")  # the copy's registry, not this checkout's
    assert names.split(",") == sorted({*registry.names(), "parrot"}) and tool == "envs.parrot.tool:EchoTool"


@pytest.mark.parametrize("half_made, says", [
    ({"tool.py": "class MazeTool: ...\n"},
     "envs/maze/__init__.py declares no ENV, so envs/maze/ is no env yet: declare it there (as envs/echo/__init__.py "
     "does), or move the folder out of envs/"),
    ({"__init__.py": 'ENV = {"upstream_env_name": "maze_env", "tool_class": "tool:MazeTool"}\n'},
     "envs/maze/__init__.py: ENV: 'task' missing; 'server_parts' missing; 'episode_budget_tokens' missing (keys: "
     "upstream_env_name, tool_class, task, server_parts, episode_budget_tokens; as envs/echo/__init__.py)"),
    ({"__init__.py": 'ENV = dict(upstream_env_name="maze_env")\n'},
     "envs/maze/__init__.py: ENV is not a literal dict (strings and numbers only); write it as envs/echo/__init__.py "
     "does"),
    ({"__init__.py": (ROOT / "envs/echo/__init__.py").read_text().replace("tool:EchoTool", "tool:MazeTool")},
     "envs/maze/__init__.py: ENV['tool_class'] = 'tool:MazeTool': no module 'envs.maze.tool'; fix the declaration (or "
     "the name in the folder)"),
])
def test_a_half_made_env_folder_fails_the_import_naming_it(tmp_path, half_made, says):
    envs = _envs_copy(tmp_path)
    (envs / "maze").mkdir()
    for name, text in half_made.items():
        (envs / "maze" / name).write_text(text)
    out = _import_registry(tmp_path)
    assert out.returncode != 0 and out.stderr.splitlines()[-1] == f"envs.registry.RegistryError: {says}"


def test_a_misspelled_declaration_fails_the_import_with_one_line(tmp_path):
    envs = _envs_copy(tmp_path)
    declaration = envs / "wordle" / "__init__.py"
    assert '"tool:WordleTool"' in declaration.read_text()
    declaration.write_text(declaration.read_text().replace('"tool:WordleTool"', '"tool:WordleTol"'))
    out = _import_registry(tmp_path)
    assert out.returncode != 0
    assert out.stderr.splitlines()[-1] == (
        "envs.registry.RegistryError: envs/wordle/__init__.py: ENV['tool_class'] = 'tool:WordleTol': "
        "envs/wordle/tool.py defines no 'WordleTol' (did you mean 'WordleTool'?); fix the declaration (or the name in the "
        "folder)")


def test_a_folder_left_with_only_its_bytecode_is_no_env(tmp_path):
    envs = _envs_copy(tmp_path)
    (envs / "removed" / "__pycache__").mkdir(parents=True)  # a branch switch leaves these behind
    assert [f.name for f in registry.env_folders(envs)] == sorted(registry.names())


@pytest.mark.parametrize("field, value, says", [
    ("task_module", "envs.echo.tsk", "ENV['task'] = 'tsk': no module 'envs.echo.tsk' (did you mean 'task'?)"),
    ("server_parts_path", "envs.ecoh.server:server_parts",
     "ENV['server_parts'] = 'envs.ecoh.server:server_parts': no module 'envs.ecoh' (did you mean 'echo'?)"),
    ("tool_class_path", "envs.echo.tool", "ENV['tool_class'] = 'tool': a path is 'module:name'"),
])
def test_check_spec_names_the_typo(field, value, says):
    import dataclasses

    with pytest.raises(registry.RegistryError, match=re.escape(f"envs/echo/__init__.py: {says}")):
        registry.check_spec(dataclasses.replace(registry.get("echo"), **{field: value}))


def test_the_import_check_runs_no_env_code():
    code = ("import sys, envs.registry; "
            "print(sorted(m for m in sys.modules if m.startswith('envs.') and m.count('.') == 2))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"  # found and parsed, never imported: a light import stays light


@pytest.mark.parametrize("source, defined", [
    ("class EchoTool(EnvTool):\n    pass\n", True), ("async def server_parts():\n    pass\n", True),
    ("EchoTool: type = Base\n", True), ("from envs.base import (\n    Other,\n    EchoTool,\n)\n", True),
    ("def helper():\n    EchoTool = 1\n", False), ("class EchoTools:\n    pass\n", False),
])
def test_what_counts_as_defined(source, defined):
    name = "server_parts" if "server_parts" in source else "EchoTool"
    assert registry._defines(source, name) is defined
