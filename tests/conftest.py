"""Fixtures shared by every test folder (helpers live in tests/helpers.py)."""

import os
from pathlib import Path

import pytest

from tests.helpers import ROOT, docker_ready, make_tiny_model

GPU_PATH = ROOT / "tests" / "gpu_path"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """A test that asks for the engine (the `docker` fixture, itself or through another fixture) carries the `docker`
    marker, so `-m "not docker"` (make test-host, run with no engine reachable) never needs one; a docker test in
    tests/gpu_path carries `twin` too."""
    for item in items:
        if "docker" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("docker"):
            item.add_marker(pytest.mark.docker)
        # the container tests that start the vLLM CPU twin, as one selection (-m twin; docs/tests.md: streams tried)
        if item.get_closest_marker("docker") and GPU_PATH in item.path.parents:
            item.add_marker(pytest.mark.twin)


# Session fixtures holding containers, torn down after the last test of the session that uses them rather than at its
# end: idle, a container still takes CPU (Docker's health checks every 2-10 s, the servers' timers; an idle twin and
# env server took ~6 CPU-s a minute, 2026-12-07) from the 10-15 minutes of tests after them on a 2-core machine.
RELEASED_AFTER_LAST_USE = ("rehearsal_stack", "env_stack")  # tests/gpu_path/conftest.py, tests/reliability/conftest.py


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    for name in RELEASED_AFTER_LAST_USE:
        if name in item.fixturenames:
            items = item.session.items
            later = items[items.index(item) + 1:] if item in items else [nextitem]
            if not any(other is not None and name in other.fixturenames for other in later):
                fixturedef = item._request._fixture_defs.get(name)  # pytest's own teardown of it, run now
                if fixturedef is not None:
                    fixturedef.finish(item._request)  # at the session's end it has nothing left to do
    return result


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
