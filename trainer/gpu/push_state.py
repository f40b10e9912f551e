"""Server mode's weight-push marker: whether the last trainer left the vllm service mid weight push.

A stuck or killed sync leaves vLLM wedged where its /health cannot tell: the workers blocked in their NCCL receive,
or `start_weight_update` done (layers on the meta device) with no `finish_weight_update`, so the next start answers
"already active". The trainer (rank 0) writes `<OUTPUT_DIR>/.vllm-weight-push.json` once the weight-transfer group
forms, marks each push in flight and done, and removes the file at a clean finish. It lives at the outputs volume's
root, not in a run folder: the vllm service outlives runs and run names.

The next launch (trainer.launch, before any process starts, so the exit code is the container's whatever the
process count) finds a marker left behind, or a vLLM that does not answer a one-token completion in time, and
exits with EXIT_VLLM_RESTART; `make train` then restarts the vllm service, health-gated, and starts the trainer
again (tools/commands/train.py). Why the trainer decides and the host acts: the trainer already mounts the outputs
volume and talks to vLLM; the host, which has Docker, would otherwise need a container just to read one file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from contract.defaults import EXIT_VLLM_RESTART  # shared with the host, which acts on it

__all__ = ["EXIT_VLLM_RESTART", "configure", "restart_reason", "restart_line"]
MARKER_NAME = ".vllm-weight-push.json"

_STATE: dict[str, str] = {}  # output_dir, run: set on rank 0 by configure(); unset elsewhere (no marker written)


def marker_path(output_dir: str) -> Path:
    return Path(output_dir) / MARKER_NAME


def configure(output_dir: str, run: str) -> None:
    """Called by server mode's preflight (rank 0 only): from now on this process records its pushes."""
    _STATE.update(output_dir=output_dir, run=run)


def _write(state: str, detail: str) -> None:
    if not _STATE:
        return
    path = marker_path(_STATE["output_dir"])
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"state": state, "since": now, "run": _STATE["run"], "detail": detail}))
    os.replace(partial, path)  # never a half-written marker


def group_formed(detail: str) -> None:
    _write("group", f"weight-transfer group formed ({detail}); no push in flight")


def push_started(step: int) -> None:
    _write("push", f"weight push in flight (before step {step + 1})")


def push_done(step: int) -> None:
    _write("group", f"last push completed (before step {step + 1}); no push in flight")


def clean_finish() -> None:
    """The run ended with no push in flight: vLLM is left usable."""
    if _STATE:
        marker_path(_STATE["output_dir"]).unlink(missing_ok=True)


def read(output_dir: str) -> dict | None:
    path = marker_path(output_dir)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # unreadable: treat as left behind, say so
        return {"state": "unknown", "since": "?", "run": "?", "detail": f"unreadable marker ({exc})"}


def restart_reason(output_dir: str, url: str, timeout_s: float) -> str | None:
    """Why the vllm service needs a restart before this run, or None. A marker left behind is consumed here: the
    caller exits with EXIT_VLLM_RESTART and `make train` restarts vLLM (a trainer started by hand says how)."""
    left = read(output_dir)
    if left is not None:
        marker_path(output_dir).unlink(missing_ok=True)
        return (f"the last run ({left.get('run')}) ended without a clean finish after the weight-transfer group "
                f"formed: {left.get('detail')} since {left.get('since')}; vLLM may be wedged")
    from trainer.gpu.server import VLLMPreflightError, one_token, wait_healthy

    try:
        wait_healthy(url, timeout_s)
    except VLLMPreflightError:
        return None  # not up (or a dead engine): preflight says so with its fix; a restart is not the cure here
    problem = one_token(url, timeout_s)
    return f"vLLM at {url}: {problem}" if problem else None


def restart_line(reason: str) -> str:
    return (f"[launch] {reason}. The vllm service needs a restart: `make train` does it and trains again; by hand: "
            "`docker compose up -d --no-deps --force-recreate --wait vllm`, then train again "
            f"(exit {EXIT_VLLM_RESTART})")
