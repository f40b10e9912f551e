"""`make dashboard`'s service: trackio's UI when REPORT_TO names trackio, else TensorBoard; on port 6006 in the
container (compose publishes it on 127.0.0.1:DASHBOARD_PORT only).

    python -m trainer.dashboard [--dry-run]   # --dry-run: print the command instead of running it
"""

from __future__ import annotations

import os
import sys

from contract import tracker_names

PORT = 6006
OUTPUTS = "/outputs"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        names = tracker_names.parse(os.environ.get("REPORT_TO") or "tensorboard")
    except ValueError as exc:
        print(f"[dashboard] REPORT_TO: {exc}", file=sys.stderr)
        return 2
    if "trackio" not in names:
        cmd = ["tensorboard", "--logdir", OUTPUTS, "--host", "0.0.0.0", "--port", str(PORT)]
        print(f"[dashboard] {' '.join(cmd)}", flush=True)
        return 0 if "--dry-run" in argv else os.execvp(cmd[0], cmd)
    problem = tracker_names.check_installed(["trackio"])
    if problem:
        print(f"[dashboard] {problem}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRACKIO_DIR", f"{OUTPUTS}/{tracker_names.TRACKIO_DIR}")  # before trackio is imported
    print(f"[dashboard] trackio's UI on {os.environ['TRACKIO_DIR']}", flush=True)
    if "--dry-run" in argv:
        return 0
    import trackio

    # 0.0.0.0 inside the container, which publishes the port on 127.0.0.1 only.
    trackio.show(project=tracker_names.PROJECT, host="0.0.0.0", server_port=PORT, open_browser=False, block_thread=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
