"""RESUME: where a run starts. fresh wipes the run folder; auto continues from the last complete checkpoint and drops
the metric records logged after it (rank 0 decides, trainer.run.training)."""

from __future__ import annotations

import shutil
from pathlib import Path

from contract.config import RunConfig
from trainer.run import checkpoints
from trainer.core.dist import log


def prepare_run_dir(cfg: RunConfig) -> tuple[str | None, int]:
    """Apply RESUME: fresh wipes the run folder; auto picks the last complete checkpoint and dedupes metrics."""
    from trainer.core.metrics import truncate_metrics

    run_dir = Path(cfg.run_dir)
    if cfg.resume == "fresh" and run_dir.exists():
        log(f"RESUME=fresh: deleting {run_dir} and starting over")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt, step, incomplete = checkpoints.last_complete(run_dir)
    for path, why in incomplete:  # cut short by a kill mid-save: unusable, and it would shadow the good one
        log(f"removing incomplete {path.name}: {why}" + (f"; resuming from {ckpt.name}" if ckpt else ""))
        shutil.rmtree(path, ignore_errors=True)
    if ckpt is None:
        dropped = truncate_metrics(run_dir, 0)
        if dropped:
            log(f"no checkpoint yet: dropped {dropped} metric records of an earlier attempt")
        log(f"starting fresh in {run_dir}")
        return None, 0
    dropped = truncate_metrics(run_dir, step)
    log(f"resuming from {ckpt} (step {step} of {cfg.max_steps}); set RESUME=fresh to start over"
        + (f"; dropped {dropped} metric records logged after that checkpoint" if dropped else ""))
    return str(ckpt), step
