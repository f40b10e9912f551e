"""One config, four places: contract.config.RunConfig, .env.example, compose.yaml, docs/configuration.md's table; the
last three follow the first through `make config-docs` (tools/commands/config_docs.py)."""

from __future__ import annotations

import re
import shutil

import yaml

from tests.helpers import ROOT
from tools.commands.config_docs import FIXED_BY_COMPOSE
from tools.errors import parse_env_file


def docs_table_vars() -> list[str]:
    text = (ROOT / "docs/configuration.md").read_text()
    section = text.split("# Configuration: every `.env` variable", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Z0-9_]+)` \|", section, flags=re.M)


def test_every_run_config_field_is_a_documented_env_variable():
    from contract.config import ENV_VARS

    example = set(parse_env_file(ROOT / ".env.example"))
    missing = [v for v in ENV_VARS if v not in example and v not in FIXED_BY_COMPOSE]
    assert not missing, f"RunConfig fields missing from .env.example: {missing}"


def test_docs_table_lists_exactly_the_env_example_variables():
    example = list(parse_env_file(ROOT / ".env.example"))
    table = docs_table_vars()
    assert len(table) == len(set(table)), "a variable appears twice in docs/configuration.md's table"
    assert sorted(table) == sorted(example)


def test_the_committed_configuration_page_is_what_the_command_prints():
    from tools.commands.config_docs import PAGE, page

    assert (ROOT / PAGE).read_text() == page(), (
        f"{PAGE} is stale: run `make config-docs` and commit it")


def test_a_new_env_example_key_without_a_description_is_named_with_where_to_write_it(tmp_path, monkeypatch):
    import pytest

    from tools.commands import config_docs

    example = tmp_path / ".env.example"
    example.write_text("MAX_STEPS=\nMY_NEW_LIMIT=4g\n")
    monkeypatch.setattr(config_docs, "ENV_EXAMPLE", example)
    with pytest.raises(SystemExit, match="MY_NEW_LIMIT in .env.example has no description: .*COMPOSE_ONLY"):
        config_docs.page()


def test_compose_passes_every_run_config_field_to_both_trainers():
    from contract.config import ENV_VARS

    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for name in ("trainer", "trainer-cpu"):
        env = services[name]["environment"]
        missing = [v for v in ENV_VARS if v not in env]
        assert not missing, f"{name} does not receive {missing}"


def test_the_committed_files_are_what_make_config_docs_leaves():
    from tools.commands import config_docs

    assert config_docs.drift() == []  # `python -m tools config-docs --check` exits 0


def test_a_setting_added_to_one_section_reaches_the_docs_env_example_and_compose(tmp_path):
    """#62: a new trainer setting is written once, on its section (here a subclass of contract.config's training
    section); the check names every file that lacks it until `make config-docs` writes them, then passes."""
    from pydantic import Field

    from contract.config import RunConfig
    from contract.config.training import TrainingSettings
    from tools.commands import config_docs

    class TrainingPlus(TrainingSettings):
        warmup_steps: int = Field(0, ge=0, description="Optimizer steps the learning rate ramps up over.")

    class Extended(TrainingPlus, RunConfig):
        pass

    (tmp_path / "docs").mkdir()
    for name in (".env.example", "compose.yaml", config_docs.PAGE):
        shutil.copy(ROOT / name, tmp_path / name)
    assert config_docs.drift(RunConfig, tmp_path) == []
    # the page lists .env.example's keys: it follows once the example has the new line
    assert config_docs.drift(Extended, tmp_path) == [
        ".env.example lacks WARMUP_STEPS", "compose.yaml x-run-config lacks WARMUP_STEPS"]
    assert config_docs.write(Extended, tmp_path) == [".env.example", "compose.yaml", config_docs.PAGE]
    assert config_docs.drift(Extended, tmp_path) == [] and config_docs.write(Extended, tmp_path) == []
    assert parse_env_file(tmp_path / ".env.example")["WARMUP_STEPS"] == ""
    services = yaml.safe_load((tmp_path / "compose.yaml").read_text())["services"]
    assert all(services[name]["environment"]["WARMUP_STEPS"] == "${WARMUP_STEPS:-}" for name in config_docs.TRAINERS)
    assert "| `WARMUP_STEPS` | `0` | Optimizer steps the learning rate ramps up over. |" in (
        tmp_path / config_docs.PAGE).read_text()
    # the rest of each file as it was: only the new setting's lines were added
    for name in (".env.example", "compose.yaml"):
        before, after = (ROOT / name).read_text().splitlines(), (tmp_path / name).read_text().splitlines()
        assert [line for line in after if line not in before] and all(line in after for line in before)
    assert Extended.load([], warmup_steps=3).warmup_steps == 3


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


def test_a_misspelled_env_key_is_named_with_the_setting_it_resembles_and_legitimate_keys_are_not():
    from tools.env_keys import unread_keys

    assert unread_keys(parse_env_file(ROOT / ".env.example")) == []  # every key the example names is read
    legit = {"ENV_CONNECT4_IMAGE": "org/env:1", "ENV_CONNECT4_REPLICAS": "auto", "ENV_CONNECT4_USER": "1000",
             "HF_TOKEN": "x", "MY_APP_PORT": "9000", "WANDB_PROJECT": "p", "NCCL_IB_DISABLE": "1"}
    assert unread_keys(legit) == []
    lines = unread_keys({"LEARNIG_RATE": "0.1", "MY_OWN_THING": "1", **legit})
    assert len(lines) == 2 and "LEARNIG_RATE" in lines[0] and "did you mean LEARNING_RATE?" in lines[0], lines
    assert lines[1].startswith("MY_OWN_THING in .env: no setting reads it")


def test_make_train_warns_of_a_misspelled_key_before_anything_starts(monkeypatch, capsys):
    import pytest

    from tools.commands import train
    from tools.plan import make_plan
    from tools.prepare import Prepared

    class Started(Exception):
        pass

    def bring_up(prepared, **kwargs):
        raise Started

    monkeypatch.setattr(train, "bring_up", bring_up)
    plan = make_plan({"TRAIN_MODE": "cpu", "LEARNIG_RATE": "0.1"}, None)
    with pytest.raises(Started):
        train.train(Prepared(plan, {}), [])
    assert "LEARNIG_RATE in .env: no setting reads it (did you mean LEARNING_RATE?)" in capsys.readouterr().out
