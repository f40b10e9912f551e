"""Fixtures shared by every test folder (helpers live in tests/helpers.py)."""

import os
from pathlib import Path

import pytest

from tests.helpers import docker_ready, make_tiny_model


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """A test that asks for the engine (the `docker` fixture, itself or through another fixture) carries the `docker`
    marker, so `-m "not docker"` (make test-host, run with no engine reachable) never needs one."""
    for item in items:
        if "docker" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.docker)


@pytest.fixture(scope="session")
def docker() -> None:
    """Fail loudly (not skip) when the engine is missing: CI must run these tests."""
    if not docker_ready():
        pytest.fail("Docker engine not reachable: start it, or run `bash .ci/provision` (CI does)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The CPU profile's tiny model (`python -m trainer.tiny_model`, what model-init runs), made once per test session
    for every folder (~15-30 s); world-readable, since containers (uid 10001) mount it read-only. TINY_MODEL_DIR
    names one made earlier, or where to make it (`make test` makes it once there for both its parts)."""
    reuse = os.environ.get("TINY_MODEL_DIR")
    if reuse:
        return make_tiny_model(Path(reuse))
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3")
