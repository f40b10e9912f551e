"""Names -> environments. Importable with no heavy dependency: everything resolves lazily.

The built-in envs are the folders under envs/ (but core/ and generic/, the code they share): each declares itself in
its `envs/<name>/__init__.py`, a literal `ENV = {...}` (what upstream OpenEnv's env folders say in their
openenv.yaml), read here without importing the env's code; a new env is its folder alone. A folder that does not
declare itself, or whose declaration names a module or class it does not have, stops this import with one line naming
the folder.

    from envs.registry import get, resolve
    spec = get("echo")
    spec.tool_class            # the TRL environment_factory class (imported on first use)
    spec.make_dataset(64, 0)   # rows: {"prompt": [...chat...], **reset kwargs}
    resolve("connect4", "http://env-connect4:8000")  # any other name: learned from its running server
"""

from __future__ import annotations

import importlib
import importlib.util
import random
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

from envs import naming

ENVS_DIR = Path(__file__).resolve().parent
SHARED = ("core", "generic")  # envs/'s folders of shared code: every other folder is an env
DECLARATION = "__init__.py"  # where a folder declares itself: `ENV = {key: literal, ...}` at its top level
# ENV's keys -> EnvSpec's fields; the module paths are the folder's ("tool:EchoTool" is envs.<name>.tool:EchoTool)
KEYS = {"upstream_env_name": "upstream_env_name", "tool_class": "tool_class_path", "task": "task_module",
        "server_parts": "server_parts_path", "episode_budget_tokens": "episode_budget_tokens"}


class RegistryError(ValueError):
    """An env folder that does not declare itself, or whose declaration points at no module or no name: raised when
    the registry is imported."""


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _near(word: str, choices: Any) -> str:
    import difflib  # only on the error path

    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _modules_in(package: str) -> list[str]:
    """The modules of `package` ("": the top level), for a suggestion on the error path."""
    import pkgutil

    where = importlib.util.find_spec(package).submodule_search_locations if package else None
    return [m.name for m in pkgutil.iter_modules(where)]


def _module_file(module: str) -> str:
    """The source file of `module`, found without running it (only its parent packages' light __init__ run);
    a LookupError with the reason otherwise."""
    parent, _, leaf = module.rpartition(".")
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as exc:  # a parent package is missing
        missing = exc.name or parent
        above, _, name = missing.rpartition(".")
        raise LookupError(f"no module {missing!r}" + _near(name, _modules_in(above)))
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise LookupError(f"no module {module!r}" + _near(leaf, _modules_in(parent)))
    return spec.origin


def _defines(source: str, name: str) -> bool:
    """Whether module text `source` defines `name` at its top level, read without importing it: a quick look for
    the usual spellings first (import time stays low), the parsed module when that finds none."""
    quoted = re.escape(name)
    if re.search(rf"^(?:(?:async\s+)?def|class)\s+{quoted}\b|^{quoted}\s*[:=]", source, re.M):
        return True
    return name in _top_level_names(source)


def _top_level_names(source: str) -> set[str]:
    """What a module defines at its top level (defs, classes, assignments, imports)."""
    import ast  # only when the quick look above found nothing

    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
    return names


def check_spec(spec: "EnvSpec") -> None:
    """Every dotted path of `spec` names a module that exists and (for `module:name`) a name it defines, checked
    without importing the env's code or its dependencies. A RegistryError of one line naming the folder otherwise."""
    for field in fields(spec):
        value = getattr(spec, field.name)
        if not (field.name.endswith("_path") or field.name.endswith("_module")):
            continue
        module, _, attr = value.partition(":")
        key = next(k for k, f in KEYS.items() if f == field.name)
        try:
            source = _module_file(module)
            if field.name.endswith("_path") and not attr:
                raise LookupError("a path is 'module:name'")
            if attr and not _defines(text := Path(source).read_text(encoding="utf-8"), attr):
                shown = module.replace(".", "/") + ("/__init__.py" if source.endswith("__init__.py") else ".py")
                raise LookupError(f"{shown} defines no {attr!r}" + _near(attr, _top_level_names(text)))
        except LookupError as exc:
            shown = value.removeprefix(f"envs.{spec.name}.")
            raise RegistryError(f"envs/{spec.name}/{DECLARATION}: ENV[{key!r}] = {shown!r}: {exc}; "
                                f"fix the declaration (or the name in the folder)") from None


@dataclass(frozen=True)
class EnvSpec:
    name: str
    upstream_env_name: str  # the env_name upstream's app passes to create_app
    tool_class_path: str
    task_module: str
    server_parts_path: str  # -> (factory, Action, Observation, State) for create_app
    episode_budget_tokens: int  # rough completion tokens one episode needs (preflight warning)

    @property
    def tool_class(self) -> type:
        return _resolve(self.tool_class_path)

    def _task(self) -> Any:
        return importlib.import_module(self.task_module)

    def make_dataset(self, n: int, seed: int) -> list[dict]:
        """`n` rows: `prompt` (chat messages) plus the kwargs the tool class's `reset(**row)` takes."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return self._task().make_dataset(n, seed)

    def demo_calls(self, row: dict, observation: str | None = None) -> list[tuple[str, dict]]:
        """An expert's tool calls for `row` (for a supervised warm-start of a tiny model). `observation`: the reset's
        text, for envs learned from their server (a built-in env's expert knows its task from the row)."""
        return self._task().demo_calls(row)

    def baseline_action(self, rng: random.Random, observation_text: str) -> tuple[str, dict]:
        """A random legal tool call given the last observation text (for `make baseline`)."""
        return self._task().baseline_action(rng, observation_text)

    def server_parts(self) -> tuple[Callable[[], Any], type, type, type]:
        return _resolve(self.server_parts_path)()


def env_folders(root: Path = ENVS_DIR) -> list[Path]:
    """The built-in envs' folders under `root`, sorted: every folder but the shared code's, and but one holding
    nothing but __pycache__ (what a removed env leaves behind after a branch switch)."""
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name not in SHARED and p.name != "__pycache__"
                  and any(c.name != "__pycache__" for c in p.iterdir()))


def declared(folder: Path) -> EnvSpec:
    """The spec `folder`'s ENV declares, checked (check_spec); a RegistryError of one line naming the folder."""
    name, where = folder.name, f"envs/{folder.name}/{DECLARATION}"
    if not re.fullmatch(naming.NAME_PATTERN, name) or name in naming.RESERVED:
        raise RegistryError(f"envs/{name}/: {name!r} is not an env name (lowercase letters, digits and '_', starting "
                            "with a letter): rename the folder")
    given = _declaration(folder, where)
    problems = [f"unknown key {k!r}" + _near(k, KEYS) for k in given if k not in KEYS]
    problems += [f"{k!r} missing" for k in KEYS if k not in given]
    problems += [f"{k!r}: {v!r} is not " + ("a positive whole number" if k == "episode_budget_tokens" else "a string")
                 for k, v in given.items() if k in KEYS and not (
                     type(v) is int and v > 0 if k == "episode_budget_tokens" else isinstance(v, str) and v)]
    if problems:
        raise RegistryError(f"{where}: ENV: {'; '.join(problems)} (keys: {', '.join(KEYS)}; as envs/echo/{DECLARATION})")
    paths = {"tool_class", "task", "server_parts"}
    spec = EnvSpec(name=name, **{KEYS[k]: f"envs.{name}.{v}" if k in paths else v for k, v in given.items()})
    check_spec(spec)
    return spec


def _declaration(folder: Path, where: str) -> dict:
    """The literal `ENV = {...}` at the top level of the folder's __init__.py, read without running it."""
    import ast

    try:
        source = (folder / DECLARATION).read_text(encoding="utf-8")
        tree = ast.parse(source, where)
    except (FileNotFoundError, SyntaxError):
        tree = None
    value = next((node.value for node in (tree.body if tree else [])
                  if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["ENV"]), None)
    if value is None:
        raise RegistryError(f"{where} declares no ENV, so envs/{folder.name}/ is no env yet: declare it there (as "
                            f"envs/echo/{DECLARATION} does), or move the folder out of envs/")
    try:
        given = ast.literal_eval(value)
    except ValueError:
        given = None
    if not isinstance(given, dict):
        raise RegistryError(f"{where}: ENV is not a literal dict (strings and numbers only); write it as "
                            f"envs/echo/{DECLARATION} does")
    return given


# Found when the registry is imported: a half-made or misspelled env fails here, rather than when a run reaches it.
_SPECS = {folder.name: declared(folder) for folder in env_folders()}
NAMES = tuple(_SPECS)  # the built-in envs: a new one is its folder (its __init__.py's ENV), nothing else


def names() -> tuple[str, ...]:
    """The built-in envs now (read at call time, so a spec added after import counts too)."""
    return tuple(_SPECS)


def get(name: str) -> EnvSpec:
    """The spec for `name`; a ValueError naming the valid choices otherwise."""
    key = (name or "").strip().lower()
    if key not in _SPECS:
        raise ValueError(f"Unknown environment {name!r}; valid choices: {', '.join(names())}.")
    return _SPECS[key]


def is_builtin(name: str) -> bool:
    return (name or "").strip().lower() in _SPECS


def resolve(name: str, url: str, **generic_options: Any) -> Any:
    """The built-in spec for `name`, else a `GenericSpec` whose tools are learned from the OpenEnv
    server at `url` (`generic_options`: instruction, prompts_file, reward, observation_chars).
    Raises envs.generic.InterfaceError (or UnsupportedSchema) with one line naming the problem."""
    if is_builtin(name):
        return get(name)
    from envs.generic import GenericSpec

    return GenericSpec.discover(name, url, **generic_options)
