"""The host side's Python (tools/host_python.py, run by the Makefile before it makes .venv): 3.10 to 3.13 as
pyproject.toml says, and an interpreter whose venv cannot install pip is one line naming the package to install."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tools import host_python

HERE = "{}.{}".format(*sys.version_info[:2])


def test_the_supported_range_is_pyprojects_requires_python():
    spec = re.search(r'^requires-python = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    (low, high) = host_python.SUPPORTED
    assert spec == f">={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"


@pytest.mark.parametrize("version", [(3, 10), (3, 11), (3, 12), (3, 13)])
def test_supported_versions_with_ensurepip_pass(version):
    assert host_python.problem(version=version, find_spec=lambda name: object()) is None


@pytest.mark.parametrize("version", [(3, 9), (3, 14), (2, 7)])
def test_a_version_out_of_range_is_one_line_naming_the_range(version):
    line = host_python.problem(version=version, find_spec=lambda name: object(), executable="/usr/bin/python3")
    assert line.startswith("/usr/bin/python3 is Python {}.{}; the host side runs on Python 3.10 to 3.13".format(*version))
    assert "PYTHON=/path/to/python3.13" in line and "\n" not in line


def test_make_tests_venv_needs_311_as_its_pins_do():
    assert host_python.problem(version=(3, 10), find_spec=lambda name: object()) is None
    line = host_python.problem(version=(3, 10), find_spec=lambda name: object(), tests=True)
    assert "make test's packages (trl, open-spiel) need Python 3.11 to 3.13" in line
    assert host_python.problem(version=(3, 11), find_spec=lambda name: object(), tests=True) is None


@pytest.mark.parametrize("missing", ["venv", "ensurepip"])
def test_a_missing_venv_or_ensurepip_names_the_debian_package(missing):
    line = host_python.problem(version=(3, 13), find_spec=lambda name: None if name == missing else object(),
                               executable="/usr/bin/python3")
    assert line.startswith(f"python -m venv needs {missing} and /usr/bin/python3 has none")
    assert "sudo apt install python3.13-venv" in line


# Debian's python3 without python3-venv: no ensurepip module, and `-m venv` makes the folder, then prints Debian's
# message (CPython's venv/__init__.py as Debian patches it) and exits 1.
DEBIAN_WITHOUT_VENV = """#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin" && ln -sf {real} "$3/bin/python"
  cat <<'MSG'
The virtual environment was not created successfully because ensurepip is not
available.  On Debian/Ubuntu systems, you need to install the python3-venv
package using the following command.

    apt install python{here}-venv

You may need to use sudo with that command.  After installing the python3-venv
package, recreate your virtual environment.

MSG
  exit 1
fi
exec {real} -c 'import runpy, sys; sys.modules["ensurepip"] = None; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")' "$@"
"""


def test_make_with_a_python_without_ensurepip_stops_with_one_line_naming_the_package(tmp_path):
    for name in ("Makefile", "pyproject.toml", "tools"):  # a checkout without .venv, so make runs the venv step
        (tmp_path / name).symlink_to(ROOT / name)
    python = tmp_path / "python3"
    python.write_text(DEBIAN_WITHOUT_VENV.format(real=sys.executable, here=HERE))
    python.chmod(0o755)
    # as a user's shell runs it: not a sub-make of `make test` (MAKELEVEL would make its own line "make[1]: ***")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    r = subprocess.run(["make", "--no-print-directory", "doctor", f"PYTHON={python}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0 and r.stdout == ""
    ours = [line for line in r.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]
    assert ours == [f"error: python -m venv needs ensurepip and {sys.executable} has none: install python3-venv "
                    f"(Debian/Ubuntu: sudo apt install python{HERE}-venv), or run make with "
                    "PYTHON=/path/to/another/python3"]
    assert not (tmp_path / ".venv").exists()  # nothing half-made for the next run to trip on


@pytest.mark.parametrize("returncode, stdout", [(1, ""), (0, '""\n'), (0, "")])
def test_an_engine_that_does_not_answer_is_named_whatever_the_cli_exits_with(monkeypatch, returncode, stdout):
    """Debian trixie's docker CLI (26.1) exits 0 and prints "" when no engine answers (found by make check-python)."""
    from tools import docker_host

    stderr = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?\n"
    monkeypatch.setattr(docker_host.shutil, "which", lambda name: "/usr/bin/docker")
    monkeypatch.setattr(docker_host, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, returncode, stdout, stderr))
    assert docker_host.check_docker().startswith("the Docker engine is not answering (Cannot connect to the Docker")
    monkeypatch.setattr(docker_host, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, '"28.2.2"\n', ""))
    assert docker_host.check_docker() is None
