"""Host-side hygiene for secrets and image names (SECURITY.md): `make doctor` flags a token directory other users
can enter, and an image name from .env can never be read by docker as an option."""

from __future__ import annotations

import pytest

from tools import docker_host
from tools.env_kinds import env_kinds
from tools.errors import StackError


def token_env(tmp_path, dir_mode: int, file_mode: int = 0o644) -> dict[str, str]:
    secrets = tmp_path / ".secrets"
    secrets.mkdir()
    token = secrets / "hf_token"
    token.write_text("hf_x\n")
    token.chmod(file_mode)
    secrets.chmod(dir_mode)
    return {"HF_TOKEN_FILE": str(token)}


def test_private_token_directory_passes(tmp_path):
    assert docker_host.check_token_file(token_env(tmp_path, 0o700)) is None


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o755, 0o777])
def test_token_directory_open_to_group_or_world_fails_with_the_fix(tmp_path, mode):
    problem = docker_host.check_token_file(token_env(tmp_path, mode))
    assert problem and "chmod 700" in problem and "other users" in problem


def test_token_file_unreadable_by_the_containers_fails(tmp_path):
    problem = docker_host.check_token_file(token_env(tmp_path, 0o700, file_mode=0o600))
    assert problem and "chmod 644" in problem


@pytest.mark.parametrize("image", ["--privileged", "-v/:/host", "a b", "img;rm", "x\n-y"])
def test_an_image_name_that_docker_would_read_as_options_is_refused_before_docker_runs(image, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(docker_host, "run", lambda cmd, **kw: ran.append(cmd))
    env = {"ENV_NAME": "thing", "ENV_THING_IMAGE": image}
    with pytest.raises(StackError) as stop:  # the CLI prints its one line on stderr and exits 2
        docker_host.check_custom_images(env_kinds(env))
    assert f"ENV_THING_IMAGE={image!r} is not an image name" in str(stop.value)
    assert ran == []


@pytest.mark.parametrize("image", ["ghcr.io/org/env:1.0", "localhost:5000/env", "openenv/echo_env:latest",
                                   "org/env@sha256:" + "a" * 64])
def test_ordinary_image_names_pass_and_reach_docker_after_a_double_dash(image, monkeypatch):
    import subprocess

    ran = []
    monkeypatch.setattr(docker_host, "run", lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    docker_host.check_custom_images(env_kinds({"ENV_NAME": "thing", "ENV_THING_IMAGE": image}))
    assert ran == [["docker", "image", "inspect", "--", image]]
