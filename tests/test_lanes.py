"""`make test` runs the container tests in two lanes at once (tests/conftest.py TWIN_LANE): each pytest process starts
its own session fixtures, so one that starts containers (a vLLM twin, an env stack) and is used in both lanes would
start twice, and a module split over both would start its module fixtures twice. Read from the collection itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Session fixtures that cost nothing worth sharing (a check, a config read, a folder laid out, the tiny model made
# once by `make test` before the lanes start: TINY_MODEL_DIR): either lane may set them up for itself.
CHEAP_PER_LANE = {"docker", "tiny_model_dir", "gpu_config", "served_config", "twin_hf_cache"}

REPORT = '''
import json


def pytest_collection_finish(session):
    rows = []
    for item in session.items:
        defs = item._fixtureinfo.name2fixturedefs
        ours = sorted(name for name, fixturedefs in defs.items()
                      if fixturedefs[-1].scope == "session" and fixturedefs[-1].baseid.startswith("tests"))
        rows.append({"module": item.nodeid.split("::")[0], "twin_lane": item.get_closest_marker("twin_lane") is not None,
                     "session_fixtures": ours})
    print("LANES " + json.dumps(rows))
'''


def container_tests(tmp_path: Path) -> list[dict]:
    (tmp_path / "lane_report.py").write_text(REPORT)
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "docker", "-p", "lane_report",
                          "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"})
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("LANES ")), None)
    assert line is not None, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(line[len("LANES "):])


def test_each_module_and_each_container_starting_session_fixture_is_in_one_lane(tmp_path):
    rows = container_tests(tmp_path)
    assert {r["twin_lane"] for r in rows} == {True, False}, "both lanes hold container tests"
    lanes_of: dict[str, set[bool]] = {}
    for r in rows:
        lanes_of.setdefault(r["module"], set()).add(r["twin_lane"])
        for name in set(r["session_fixtures"]) - CHEAP_PER_LANE:
            lanes_of.setdefault(f"session fixture {name}", set()).add(r["twin_lane"])
    split = sorted(what for what, lanes in lanes_of.items() if len(lanes) > 1)
    assert split == [], f"in both lanes (start once per lane; move them to one in tests/conftest.py TWIN_LANE): {split}"
    shared = {what for what in lanes_of if what.startswith("session fixture")}
    assert {"session fixture rehearsal_stack", "session fixture env_stack"} <= shared, shared  # the report reads them
