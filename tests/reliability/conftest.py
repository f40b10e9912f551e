"""Shared fixtures for the reliability tests: one env-server stack, and the figures summary (helpers: common.py).

`env_stack` starts env-echo, env-wordle and env-catch once per test session (our image,
`grpo-test/env-server:local`, through the real compose.yaml) with a small capacity, so the fuzz,
path-injection and soak tests share one start-up. RELIABILITY_URLS="echo=http://127.0.0.1:18001,..."
points the WS-level tests at servers you started yourself instead (container-only checks skip).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.helpers import build_images, compose_stack, service_url
from tests.reliability.common import (CAPACITY, ENV_NAMES, FIGURES, SESSION_TIMEOUT_S, EnvStack, container_id,
                                      wait_healthy)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if FIGURES:
        terminalreporter.section("reliability figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def env_stack(request, tmp_path_factory) -> Any:
    local = os.environ.get("RELIABILITY_URLS", "").strip()
    if local:
        urls = dict(pair.split("=", 1) for pair in local.split(","))
        for url in urls.values():
            wait_healthy(url)
        yield EnvStack(urls=urls)
        return
    request.getfixturevalue("docker")
    build_images("env-server")
    overrides = {"MAX_CONCURRENT_ENVS": str(CAPACITY), "ENV_SESSION_TIMEOUT_S": str(SESSION_TIMEOUT_S)}
    with compose_stack(tmp_path_factory.mktemp("reliability"), list(ENV_NAMES), overrides=overrides) as stack:
        project = stack.project
        urls, containers = {}, {}
        for name in ENV_NAMES:
            service = f"env-{name}"
            urls[name] = service_url(stack, service)
            containers[name] = container_id(project, service)
            wait_healthy(urls[name])
        yield EnvStack(urls=urls, project=project, containers=containers)


