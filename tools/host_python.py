"""Run by the Makefile with $(PYTHON) before it makes the host venv: is this interpreter one the host side runs on, and
can `python -m venv` give the venv its pip? Otherwise one line saying what to install, not venv's or pip's traceback.
`--tests`: before `make test`'s venv, whose pins need more (TESTS_FROM).

Standard library only and no f-strings: it runs on whatever interpreter PYTHON names, before any venv exists.
"""

import importlib.util
import sys

SUPPORTED = ((3, 10), (3, 13))  # pyproject.toml's requires-python (tests/tools/test_host_python.py checks they agree)
TESTS_FROM = (3, 11)  # trl 1.16.0, open-spiel 2.0.2 and pydantic-settings 2.16.3 publish nothing for 3.10


def problem(version=sys.version_info[:2], find_spec=importlib.util.find_spec, executable=sys.executable, tests=False):
    """One line saying what is wrong and what to do, or None when `python -m venv` will make a working venv."""
    low, high = (TESTS_FROM if tests else SUPPORTED[0]), SUPPORTED[1]
    here = "{}.{}".format(*version)
    if not low <= tuple(version) <= high:
        what = "make test's packages (trl, open-spiel) need" if tests else "the host side runs on"
        return ("{} is Python {}; {} Python {}.{} to {}.{}: install one and run make again with "
                "PYTHON=/path/to/python3.{}{}".format(executable, here, what, low[0], low[1], high[0], high[1],
                                                      high[1], " after rm -rf .venv" if tests else ""))
    # Debian and Ubuntu ship venv's ensurepip (and the pip wheel it installs) in a separate package.
    for module in ("venv", "ensurepip"):
        if find_spec(module) is None:
            return ("python -m venv needs {} and {} has none: install python3-venv (Debian/Ubuntu: sudo apt install "
                    "python{}-venv), or run make with PYTHON=/path/to/another/python3".format(module, executable, here))
    return None


if __name__ == "__main__":
    line = problem(tests="--tests" in sys.argv[1:])
    if line:
        sys.stderr.write("error: " + line + "\n")
        sys.exit(2)  # StackError's exit code: the host side's one-line errors all exit 2
