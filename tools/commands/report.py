"""Plot reward and tool-call curves of a run to reports/<run>.png: `report [--run R]` (trainer.report)."""

from __future__ import annotations

import os

from tools.prepare import prepare, run_in_cpu_trainer
from tools.settings import ROOT


def run(rest: list[str]) -> int:
    reports = ROOT / "reports"
    reports.mkdir(exist_ok=True)
    # as your own uid, so reports/ needs no opening to others (the outputs volume is world-readable)
    as_you = ("--user", f"{os.getuid()}:{os.getgid()}", "-e", "MPLCONFIGDIR=/tmp", "-v", f"{reports}:/reports")
    return run_in_cpu_trainer(prepare(), "-m", "trainer.report", "--outputs", "/outputs", *rest, "--out-dir", "/reports",
                              run_options=as_you)
