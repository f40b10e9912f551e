"""Two stacks on one host (two checkouts: two experiments, or the repo cloned twice) share nothing: each checkout's
STACK_NAME (tools/settings.py; by default its folder's name) is its Compose project and the first part of its image
tags. Host-only: the names are resolved by the host code of two copied checkouts, and what Compose would run is read
from `docker compose config` (the CLI, no engine), never started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tools import compose_file, images, settings
from tools.errors import StackError
from tools.plan import make_plan

# what the host code of a checkout resolves, with nothing set (neither .env nor the process names a stack)
RESOLVE = ("from tools import images, settings; s = settings.load(); "
           "print(s.stack_name, s.project, images.image_of(images.ENV_SERVER_BUILD), sep='\\n')")


def checkout(parent: Path, folder: str) -> Path:
    """The host side of a checkout (tools/, compose.yaml, .env.example) copied to parent/folder."""
    root = parent / folder
    shutil.copytree(ROOT / "tools", root / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("compose.yaml", ".env.example"):
        shutil.copy(ROOT / name, root / name)
    return root


def host_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STACK_NAME", "COMPOSE_PROJECT_NAME", "STACK_ENV_FILE")}
    return {**env, **extra}


def resolved(root: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", RESOLVE], cwd=root, env=host_env(PYTHONPATH=str(root)),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_two_checkouts_are_two_stacks_by_default(tmp_path):
    first, second = checkout(tmp_path, "grpo-stack"), checkout(tmp_path / "elsewhere", "My Experiment.2")
    assert resolved(first) == ["grpo-stack", "grpo-stack", "grpo-stack/env-server:local"]  # as before STACK_NAME
    assert resolved(second) == ["my-experiment-2", "my-experiment-2", "my-experiment-2/env-server:local"]
    (second / ".env").write_text("STACK_NAME=exp-b\n")  # the setting wins over the folder's name
    assert resolved(second) == ["exp-b", "exp-b", "exp-b/env-server:local"]


@pytest.mark.parametrize("folder, name", [("grpo-stack", "grpo-stack"), ("GRPO_Stack (copy)", "grpo-stack-copy"),
                                          ("__", "grpo-stack"), ("run.2026-12-07", "run-2026-12-07")])
def test_a_checkouts_name_is_a_valid_project_and_image_name(tmp_path, folder, name):
    assert settings.checkout_stack_name(tmp_path / folder) == name
    assert settings.StackEnv.from_values({"STACK_NAME": name}).stack_name == name  # what the setting itself accepts


@pytest.mark.parametrize("bad", ["Exp-A", "exp a", "-exp", "exp-", "exp/a"])
def test_a_bad_stack_name_says_so(bad):
    with pytest.raises(StackError, match=rf"STACK_NAME: String should match pattern .*got {bad!r}\); edit .env"):
        settings.StackEnv.from_values({"STACK_NAME": bad})


def compose_config(tmp_path: Path, values: dict[str, str]) -> dict:
    """What `make up` would hand Compose for these .env values (a CPU run of echo), as `docker compose config` reads
    it: compose.yaml, the generated file, and the plan's environment over the env file."""
    plan = make_plan(values, None)
    stack = tmp_path / plan.settings.stack_name
    stack.mkdir(parents=True)
    (stack / "compose.envs.yaml").write_text(compose_file.yaml_text(plan.generated_compose()))
    (stack / ".env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    files = [ROOT / "compose.yaml", stack / "compose.envs.yaml"]
    env = plan.compose_vars(files, environ=host_env())
    out = subprocess.run(["docker", "compose", "--env-file", str(stack / ".env"), "config", "--format", "json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def what_it_owns(config: dict) -> dict[str, set[str]]:
    services = config["services"]
    return {"project": {config["name"]},
            "images built here": {s["image"] for s in services.values() if "build" in s or s["image"].endswith(":local")},
            "volumes": {v["name"] for v in config.get("volumes", {}).values()},
            "networks": {n["name"] for n in config.get("networks", {}).values()}}


@pytest.fixture(scope="module")
def docker_compose_cli():
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.fail("`docker compose` (v2) is missing: run `bash .ci/provision`")


def test_two_stacks_side_by_side_share_no_project_image_volume_or_network(tmp_path, docker_compose_cli):
    run = {"TRAIN_MODE": "cpu", "ENV_NAME": "echo", "COMPOSE_PROFILES": "cpu,echo"}
    first = what_it_owns(compose_config(tmp_path, {**run, "STACK_NAME": "exp-a"}))
    second = what_it_owns(compose_config(tmp_path, {**run, "STACK_NAME": "exp-b"}))
    assert first["project"] == {"exp-a"} and "exp-a/env-server:local" in first["images built here"]
    assert "exp-a_outputs" in first["volumes"] and "exp-a_envnet" in first["networks"]
    for kind in first:  # `make down` in one (its project) cannot reach the other's containers, nor a build its images
        assert first[kind] and not first[kind] & second[kind], kind
        assert all(name.startswith("exp-b") for name in second[kind]), kind


def test_an_older_env_file_runs_this_stacks_env_image(tmp_path, docker_compose_cli):
    # .env.example used to set every built-in env's image to the one tag all checkouts shared
    older = {"TRAIN_MODE": "cpu", "ENV_NAME": "echo", "STACK_NAME": "exp-c", "ENV_ECHO_IMAGE": "grpo-stack/env-server:local"}
    assert compose_config(tmp_path, older)["services"]["env-echo"]["image"] == "exp-c/env-server:local"
    own = {**older, "ENV_ECHO_IMAGE": "registry.example/echo-env:1"}  # an image of one's own still runs
    assert compose_config(tmp_path / "own", own)["services"]["env-echo"]["image"] == "registry.example/echo-env:1"


def test_compose_yaml_writes_every_tag_built_here_with_the_stack_name():
    for build in images.BUILT_HERE:
        assert images.image_ref(build).startswith(images.STACK_REF + "/"), build
        assert images.image_of(build, "exp-a").startswith("exp-a/")
