"""One config, four places: contract.config.RunConfig, .env.example, compose.yaml, README's table."""

from __future__ import annotations

import re

import yaml

from tests.helpers import ROOT
from tools.stack import parse_env_file

# Set by compose for every run, not by users: the container paths and service URLs.
FIXED_BY_COMPOSE = {"OUTPUT_DIR", "VLLM_SERVER_URL", "VLLM_WORLD_SIZE"}  # the last: tools/stack.py, from VLLM_GPU


def readme_table_vars() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Configuration: every `.env` variable", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z0-9_]+)` \|", section, flags=re.M)


def test_every_run_config_field_is_a_documented_env_variable():
    from contract.config import ENV_VARS

    example = set(parse_env_file(ROOT / ".env.example"))
    missing = [v for v in ENV_VARS if v not in example and v not in FIXED_BY_COMPOSE]
    assert not missing, f"RunConfig fields missing from .env.example: {missing}"


def test_readme_table_lists_exactly_the_env_example_variables():
    example = list(parse_env_file(ROOT / ".env.example"))
    table = readme_table_vars()
    assert len(table) == len(set(table)), "a variable appears twice in the README table"
    assert sorted(table) == sorted(example)


def test_compose_passes_every_run_config_field_to_both_trainers():
    from contract.config import ENV_VARS

    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name in ("trainer", "trainer-cpu"):
        env = services[name]["environment"]
        missing = [v for v in ENV_VARS if v not in env]
        assert not missing, f"{name} does not receive {missing}"


def test_compose_fallbacks_and_env_example_repeat_the_one_python_default():
    """The model id, vLLM image and session cap are written once in Python (contract.defaults, envs.core.settings);
    compose.yaml's `${VAR:-...}` fallbacks and .env.example may only repeat them."""
    from envs.core.settings import DEFAULT_MAX_CONCURRENT_ENVS
    from contract import defaults

    wanted = {"MODEL_NAME": defaults.GPU_MODEL, "VLLM_IMAGE": defaults.VLLM_IMAGE,
              "MAX_CONCURRENT_ENVS": str(DEFAULT_MAX_CONCURRENT_ENVS)}
    compose = (ROOT / "compose.yaml").read_text()
    example = parse_env_file(ROOT / ".env.example")
    for var, value in wanted.items():
        fallbacks = set(re.findall(r"\$\{" + var + r":-([^}]*)\}", compose))
        assert fallbacks == {value}, (var, fallbacks)
        assert example[var] == value, var
    python_sources = [p for d in ("tools", "contract", "trainer", "envs") for p in (ROOT / d).rglob("*.py")]
    for value in (defaults.GPU_MODEL, defaults.VLLM_IMAGE):
        writers = [p.relative_to(ROOT).as_posix() for p in python_sources if f'"{value}"' in p.read_text()]
        assert writers == ["contract/defaults.py"], (value, writers)
