"""Fixtures shared by every test folder (helpers live in tests/helpers.py)."""

import os
from pathlib import Path

import pytest

from tests.helpers import docker_ready, make_tiny_model


# `make test` runs the container tests as two pytest processes at once (lanes), so that one lane's serial waits (a
# twin's cold start, a trainer's imports, one core busy) overlap the other's. The twin lane: these modules, which share
# session fixtures (tests/gpu_path's vLLM twins; the reliability env stack of soak, fuzz and security); the other lane:
# every other container test. Each module stays whole in one lane, so its fixtures start once. Split by measured
# time (docs/tests.md).
TWIN_LANE = ("gpu_path/", "reliability/test_soak.py", "reliability/test_fuzz_ws.py",
             "reliability/test_security_runtime.py")
TESTS = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """A test that asks for the engine (the `docker` fixture, itself or through another fixture) carries the `docker`
    marker, so `-m "not docker"` (make test-host, run with no engine reachable) never needs one; a container test
    of a TWIN_LANE module also carries `twin_lane`."""
    for item in items:
        if "docker" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.docker)
        if item.get_closest_marker("docker") and item.path.relative_to(TESTS).as_posix().startswith(TWIN_LANE):
            item.add_marker(pytest.mark.twin_lane)


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
