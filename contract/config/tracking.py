"""Where a run is written and what is logged about it: run folder, checkpoints, metrics, traces, trackers."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from contract import tracker_names


class TrackingSettings(BaseModel):
    """RUN_NAME, OUTPUT_DIR, checkpoints, logging, rollout traces and REPORT_TO's trackers."""

    run_name: str | None = Field(None, description="Run folder under OUTPUT_DIR. Empty: the env names joined by `+`.")
    output_dir: str = Field("/outputs", description="Where runs are written (checkpoints, metrics.jsonl, tensorboard/).")
    save_steps: int = Field(10, ge=1, description="Write `checkpoint-N` every this many steps.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every this many steps.")
    trace_every: int = Field(10, ge=0, description="Write a sample of rollouts to rollouts.jsonl at the first step "
                             "and every this many steps (`make rollouts` prints them); 0: never.")
    trace_samples: int | None = Field(None, ge=1, description="Rollouts written each time; empty: NUM_GENERATIONS "
                                      "(one GRPO group, the rollouts compared with each other).")
    report_to: str = Field(
        "tensorboard", description="Experiment trackers, a comma list: tensorboard (OUTPUT_DIR/<run>/tensorboard), "
        "trackio (local, OUTPUT_DIR/trackio; `make dashboard` serves its UI), wandb, mlflow; or none. Each shows the "
        "same keys (reward first; trainer/core/trackers.py). trackio, wandb and mlflow are installed in the trainer "
        "images only when named here (`make build`)."
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="REPORT_TO=wandb: offline keeps the run in OUTPUT_DIR/<run>/wandb (no network; "
        "`wandb sync` uploads it later); online needs the API key in the secret file WANDB_API_KEY_FILE."
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="REPORT_TO=mlflow: where runs go, e.g. http://mlflow-host:5000. Empty: a file store in "
        "OUTPUT_DIR/mlruns."
    )

    @field_validator("report_to")
    @classmethod
    def _check_report_to(cls, value: str) -> str:
        return ",".join(tracker_names.parse(value)) or "none"

    @field_validator("run_name")
    @classmethod
    def _check_run_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}", value):
            raise ValueError(f"{value!r} is not a folder name; use letters, digits, '.', '_', '+', '-' (edit .env)")
        return value

    @property
    def trackers(self) -> list[str]:
        return [] if self.report_to == "none" else self.report_to.split(",")

    @property
    def resolved_run_name(self) -> str:
        return self.run_name or "+".join(self.env_names)  # type: ignore[attr-defined]

    @property
    def run_dir(self) -> str:
        return f"{self.output_dir.rstrip('/')}/{self.resolved_run_name}"

    def tracking_kwargs(self) -> dict[str, Any]:
        """This section's part of what GRPOConfig and AsyncGRPOConfig both take (RunConfig.shared_trainer_kwargs)."""
        return dict(
            output_dir=self.run_dir,
            run_name=self.resolved_run_name,
            save_strategy="steps",
            save_steps=self.save_steps,
            save_total_limit=3,
            logging_steps=self.logging_steps,
            report_to="none",  # trainer.core.metrics writes JSONL + TensorBoard itself
            disable_tqdm=True,  # one log line per step instead of progress bars in `docker logs`
        )
