"""Fixtures shared by every test folder (helpers live in tests/helpers.py)."""

import pytest

from tests.helpers import docker_ready


@pytest.fixture(scope="session")
def docker() -> None:
    """Fail loudly (not skip) when the engine is missing: CI must run these tests."""
    if not docker_ready():
        pytest.fail("Docker engine not reachable: start it, or run `bash .ci/provision` (CI does)")
