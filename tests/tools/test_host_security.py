"""Host-side items of issue #30: Docker's loopback guarantee (make doctor / make up warn on engines that break it)
and make variables reaching the shell as one quoted word."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tools import docker_host

ARGV_PRINTER = f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
# The environment with nothing an outer `make test` passes down (MAKEFLAGS carries its command-line variables).
OUTER_MAKE = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTEST_ARGS", "PYTEST_ADDOPTS", "HOST_TEST_WORKERS")


def own_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in OUTER_MAKE}, **extra}


@pytest.mark.parametrize("version, firewalld, warned", [
    ("20.10.24+dfsg1", False, True), ("27.5.1", False, True), ("28.0.0", False, False), ("28.0.4", True, True),
    ("28.3.2", True, True), ("28.3.3", True, False), ("29.1.0", True, False), ("v28.1.1", False, False),
    ("dev", False, False),
])
def test_engine_versions_that_let_the_lan_reach_loopback_ports_are_warned_about(version, firewalld, warned):
    msg = docker_host.loopback_exposure(version, firewalld)
    assert bool(msg) is warned, msg
    if warned:
        assert msg.startswith(f"Docker Engine {version}:") and "Upgrade Docker Engine to >= 28." in msg
        assert "iptables -t raw -I PREROUTING -d 127.0.0.0/8 ! -i lo -j DROP" in msg
    if warned and firewalld and version.startswith("28."):
        assert "CVE-2025-54388" in msg and ">= 28.3.3" in msg


def engine() -> str:
    r = docker_host.run(["docker", "version", "--format", "{{.Server.Version}}"])
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_make_doctor_warns_about_this_engine_without_failing_for_it(tmp_path, docker):
    """Real `make doctor` against the engine here: a WARN line exactly when the version is below the fix."""
    env_file = tmp_path / "test.env"
    env_file.write_text((ROOT / ".env.example").read_text())
    env = dict(os.environ, STACK_ENV_FILE=str(env_file))
    r = subprocess.run(["make", "--no-print-directory", "doctor"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    expected = docker_host.loopback_exposure(engine(), docker_host.firewalld_running())
    lines = [line for line in r.stdout.splitlines() if "docker loopback ports" in line]
    assert lines == ([f"  WARN docker loopback ports: {expected}"] if expected else []), r.stdout
    assert "FAIL docker loopback" not in r.stdout


@pytest.mark.parametrize("target, var, flag", [
    ("export", "PUSH", "--push"), ("export", "RUN", "--run"), ("export", "CHECKPOINT", "--checkpoint"),
    ("rollouts", "STEP", "--step"), ("eval", "THRESHOLD", "--threshold"), ("eval", "TASKS", "--tasks"),
])
def test_make_variables_reach_the_tool_as_one_word_and_never_run(tmp_path, target, var, flag):
    """`make export PUSH='x;touch FILE'` used to run `touch`: the real Makefile, the real shell; the tool is
    replaced by a printer of its argv (the one thing stubbed: what the recipe hands over is the test)."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".host-ok").touch()  # newer than pyproject.toml: make does not rebuild the host venv
    pwned = tmp_path / "pwned"
    payload = f"x;touch {pwned}; echo 'q'\"d\" `touch {pwned}` (touch {pwned})"  # `$` is refused (below)
    r = subprocess.run(["make", "--no-print-directory", target, f"VENV={venv}", f"STACK={ARGV_PRINTER}",
                        f"{var}={payload}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert not pwned.exists(), "a make variable ran as shell code"
    argv = json.loads(r.stdout.strip().splitlines()[-1])
    assert argv[argv.index(flag) + 1] == payload


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("target, var, value, says", [
    ("export", "PUSH", "x\ntouch PWNED #", "PUSH holds a newline or a '$'"),  # split the recipe: ran the 2nd line
    ("export", "RUN", "$(shell touch PWNED)", "RUN holds a newline or a '$'"),  # ran even under make -n
    ("export", "CHECKPOINT", "$$(touch PWNED)", "CHECKPOINT holds a newline or a '$'"),
    ("rollouts", "STEP", "1\ntouch PWNED", "STEP holds a newline or a '$'"),
    ("eval", "TASKS", "$(shell touch PWNED)", "TASKS holds a newline or a '$'"),
    ("eval", "THRESHOLD", "0.5\ntouch PWNED", "THRESHOLD holds a newline or a '$'"),
    ("train", "ARGS", "--max-steps 3; touch PWNED", "ARGS holds a shell operator"),
    ("eval", "ARGS", "--x `touch PWNED`", "ARGS holds a shell operator"),
    ("rehearse", "ARGS", "--x && touch PWNED", "ARGS holds a shell operator"),
    ("train", "ARGS", "--x > PWNED", "ARGS holds a shell operator"),
    ("train", "ARGS", "--x $(shell touch PWNED)", "ARGS holds a newline or a '$'"),
    # #63: read by a recipe, outside the check
    ("nccl-check", "FULL", "$(shell touch PWNED)", "FULL holds a newline or a '$'"),
    ("export", "EXPORT_ADAPTER", "$(shell touch PWNED)", "EXPORT_ADAPTER holds a newline or a '$'"),
    ("test-host", "PYTEST_ARGS", "-k x $(shell touch PWNED)", "PYTEST_ARGS holds a newline or a '$'"),
    ("test-host", "PYTEST_ARGS", "-q\ntouch PWNED", "PYTEST_ARGS holds a newline or a '$'"),
])
def test_make_refuses_values_that_would_run_as_code(tmp_path, target, var, value, says, dry_run):
    """#44: `make -i export PUSH="$(printf 'x\nid #')"` ran `id`, `make -n export RUN='$(shell ...)'` ran the shell
    command, `ARGS='--max-steps 3; echo INJECTED'` ran the echo. Now: one line, exit 2, nothing run."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".host-ok").touch()
    pwned = tmp_path / "PWNED"
    r = subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), "-i", *(["-n"] if dry_run else []), target,
         f"VENV={venv}", f"STACK={ARGV_PRINTER}", f"{var}={value.replace('PWNED', str(pwned))}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert not pwned.exists(), f"make {target} {var}=... ran the injected command"
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("var, target", [("FULL", "nccl-check"), ("EXPORT_ADAPTER", "export"),
                                         ("PYTEST_ARGS", "test-host")])
def test_make_refuses_such_values_from_the_environment_too(tmp_path, var, target):
    """#63: `FULL='$(shell ...)' make -n nccl-check` ran the command: make imports the environment as variables."""
    venv = tmp_path / "venv"
    venv.mkdir()
    pwned = tmp_path / "PWNED"
    r = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "-n", target, f"VENV={venv}"], cwd=tmp_path,
                       env=own_env(**{var: f"$(shell touch {pwned})"}), capture_output=True, text=True, timeout=60)
    assert not pwned.exists(), f"{var} from the environment ran the injected command"
    assert r.returncode == 2 and f"{var} holds a newline or a '$'" in r.stderr, (r.stdout, r.stderr)


def test_make_pytest_args_reach_pytest_as_one_word_and_never_run(tmp_path):
    """#63: PYTEST_ARGS reached the shell unquoted (`PYTEST_ARGS='-q; touch x'` ran touch). Now pytest gets it whole in
    PYTEST_ADDOPTS and splits it itself, shell-like: the real Makefile and shell, pytest replaced by a printer of its
    argv and PYTEST_ADDOPTS."""
    import shlex

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".host-ok").touch()
    (venv / ".test-ok").touch()  # after .host-ok: make rebuilds neither
    printer = venv / "bin" / "python"
    printer.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                       "print(json.dumps([sys.argv[1:], os.environ.get('PYTEST_ADDOPTS')]))\n")
    printer.chmod(0o755)
    pwned = tmp_path / "pwned"
    value = f"-k 'a or (b and c)' -q; touch {pwned} | `touch {pwned}` && \"x y\""
    r = subprocess.run(["make", "--no-print-directory", "test-host", f"VENV={venv}", f"PYTEST_ARGS={value}"], cwd=ROOT,
                       env=own_env(PYTEST_ADDOPTS="-p no:cacheprovider"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert not pwned.exists(), "PYTEST_ARGS ran as shell code"
    argv, addopts = json.loads(r.stdout.strip().splitlines()[-1])
    assert argv == ["-m", "pytest", "-m", "not docker", "-n", "2"]
    assert shlex.split(addopts) == ["-p", "no:cacheprovider", *shlex.split(value)]  # the caller's own kept first


def test_make_args_still_take_several_quoted_words(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".host-ok").touch()
    r = subprocess.run(["make", "--no-print-directory", "train", f"VENV={venv}", f"STACK={ARGV_PRINTER}",
                        "ARGS=--max-steps 3 --note 'a b' --only x,y"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["train", "--max-steps", "3", "--note", "a b", "--only",
                                                             "x,y"]


@pytest.mark.parametrize("value, adapter", [("1", True), ("true", True), ("0", False), ("", False)])
def test_make_export_adapter_flag(tmp_path, value, adapter):
    """`make export EXPORT_ADAPTER=1`: a LoRA run's adapter alone (trainer.export --adapter); anything else: merged."""
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".host-ok").touch()
    r = subprocess.run(["make", "--no-print-directory", "export", f"VENV={venv}", f"STACK={ARGV_PRINTER}",
                        f"EXPORT_ADAPTER={value}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert ("--adapter" in json.loads(r.stdout.strip().splitlines()[-1])) is adapter
