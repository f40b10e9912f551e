"""tests/low-priority (make test's host part on the CPU time nothing else wants): its idle cgroup is made inside the
caller's own group (#63), in a stand-in cgroup tree (CGROUP_FS, SELF_CGROUP): plain folders and files, so the test
needs no root and changes nothing on the machine."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import ROOT


def run_in(tmp_path, own: str, tree: str, where: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    fs = tmp_path / "fs"
    (fs / where).mkdir(parents=True)  # the caller's own group
    (fs / tree / "cgroup.procs").write_text("")  # the hierarchy's root
    self_cgroup = tmp_path / "self-cgroup"
    self_cgroup.write_text(own)
    r = subprocess.run([str(ROOT / "tests" / "low-priority"), "sh", "-c", "echo ran; exit 3"], capture_output=True,
                       text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "CGROUP_FS": str(fs),
                                                   "SELF_CGROUP": str(self_cgroup)})
    made = sorted(str(idle.parent.parent.relative_to(fs)) for idle in fs.rglob("grpo-low-priority.*/cpu.idle")
                  if idle.read_text().strip() == "1")  # the folders the idle groups were made in
    return r, made


@pytest.mark.parametrize("own, tree, where", [
    # cgroup v2: inside the caller's group (before: under the root, out of the caller's memory limit)
    ("0::/user.slice/session-3.scope\n", ".", "user.slice/session-3.scope"),
    # cgroup v1 (this machine's kind): the cpu hierarchy only, in the caller's cpu group; at the root as before
    ("9:memory:/limited\n4:cpu,cpuacct:/\n0::/\n", "cpu", "cpu"),
    ("9:memory:/limited\n4:cpuacct,cpu:/docker/abc\n0::/\n", "cpu", "cpu/docker/abc"),
])
def test_the_idle_group_is_made_inside_the_callers_own_in_a_stand_in_cgroup_tree(tmp_path, own, tree, where):
    r, made = run_in(tmp_path, own, tree, where)
    assert (r.returncode, r.stdout) == (3, "ran\n"), r.stderr
    assert made == [where]
