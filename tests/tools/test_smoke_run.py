"""`make gpu-smoke`'s machinery run for real on the CPU profile (`python -m tools smoke`): the stage lines
come from a real trainer in a real container, and the verdict table passes every stage this mode has.
The GPU-only stages (model download, vLLM healthy, rendezvous, weight sync) are checked on recorded logs
in tests/gpu_path/test_gpu_host_checks.py."""

from __future__ import annotations

import pytest

from tests.helpers import EnvFileStack, build_images

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_smoke_run_on_the_cpu_profile_passes_every_stage_of_this_mode(docker, tmp_path):
    build_images("env-server", "trainer-cpu")
    stack = EnvFileStack(tmp_path, {"TRAIN_MODE": "cpu", "ENV_NAME": "echo"})
    try:
        r = stack.stack("smoke")
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        table = r.stdout.split("[stack] smoke run, mode cpu")[1]
        for title in ("first generation", "first optimizer step", "tool calls per episode"):
            assert f"  pass {title}" in table
        assert "FAIL" not in table and "smoke: PASSED" in table
        assert "training steps with `trainer-cpu` (mode cpu, ROLLOUTS=sync), run smoke-cpu" in r.stdout
    finally:
        stack.down()
