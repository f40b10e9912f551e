"""The host venv's installer (tools/venv_install.py): pip's settings as uv's flags, read from pip's own `pip config list`
on a config file and PIP_* variables, and pip kept where a setting has no uv equivalent."""

from __future__ import annotations

import os
import subprocess
import sys

from tools import venv_install


def pip_config_list(tmp_path, conf: str, **env: str) -> str:
    (tmp_path / "pip.conf").write_text(conf)
    # this file and these variables alone: no machine-wide, user or PIP_* settings of the machine running the test
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "XDG_"))}
    alone = {"HOME": str(tmp_path), "XDG_CONFIG_DIRS": str(tmp_path / "none"), "PIP_CONFIG_FILE": str(tmp_path / "pip.conf")}
    res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True,
                         env={**clean, **alone, **env})
    return res.stdout


def test_pips_indexes_links_constraints_and_certificate_become_uvs_with_pips_precedence(tmp_path):
    listing = pip_config_list(tmp_path, "[global]\nextra-index-url = file:///a/simple file:///b/simple\n"
                                        "find-links = /global/wheels\nconstraint = /c.txt\ncert = /ca.pem\n"
                                        "disable-pip-version-check = 1\n[install]\nfind-links = /install/wheels\n",
                              PIP_DEFAULT_TIMEOUT="180")
    flags, env = venv_install.uv_arguments(venv_install.pip_settings(listing))
    pairs = list(zip(flags[::2], flags[1::2]))
    assert ("--index-strategy", "unsafe-best-match") in pairs  # every index searched for the best version, as pip does
    assert ("--extra-index-url", "file:///a/simple") in pairs and ("--extra-index-url", "file:///b/simple") in pairs
    assert ("--find-links", "/install/wheels") in pairs and ("--find-links", "/global/wheels") not in pairs
    assert ("--constraint", "/c.txt") in pairs
    assert env == {"SSL_CERT_FILE": "/ca.pem", "UV_HTTP_TIMEOUT": "180"}


def test_a_pip_setting_without_a_uv_equivalent_leaves_the_install_to_pip(tmp_path):
    listing = pip_config_list(tmp_path, "[global]\nprefer-binary = 1\n")
    assert venv_install.uv_arguments(venv_install.pip_settings(listing)) is None
    # a section pip install does not read is not a reason to leave uv
    assert venv_install.uv_arguments(venv_install.pip_settings(pip_config_list(tmp_path, "[download]\nx = 1\n")))
