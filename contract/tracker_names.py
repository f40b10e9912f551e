"""Experiment tracker names (REPORT_TO) and where each keeps its data: what the run's settings accept, what the host's
`make dashboard` serves, and what the trainer logs to (trainer.core.trackers). Standard library only."""

from __future__ import annotations

import importlib.util

KNOWN = ("tensorboard", "trackio", "wandb", "mlflow")
MODULES = {"trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}  # import names of the optional ones
PROJECT = "grpo-stack"  # trackio / W&B project, MLflow experiment
TB_DIR = "tensorboard"  # under the run folder
TRACKIO_DIR = "trackio"  # under OUTPUT_DIR: one store for every run (the dashboard serves it)


def parse(value: str | None) -> list[str]:
    """REPORT_TO's names, in order, or ValueError with the fix. `none`: metrics.jsonl only."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in KNOWN]
    if unknown or not names:
        raise ValueError(f"unknown tracker {', '.join(map(repr, unknown)) or repr(value)}; write a comma list of "
                         f"{', '.join(KNOWN)} (or none) (edit .env)")
    return list(dict.fromkeys(names))


def missing_packages(names: list[str]) -> list[str]:
    return [n for n in names if n in MODULES and importlib.util.find_spec(MODULES[n]) is None]


def check_installed(names: list[str]) -> str | None:
    """One line when a tracker REPORT_TO names is not installed here (preflight), else None."""
    missing = missing_packages(names)
    if not missing:
        return None
    return (f"REPORT_TO names {', '.join(missing)}, not installed in this trainer image: the images install "
            f"REPORT_TO's trackers when they are built, so run `make build` (or `make train`, which builds) after "
            f"editing .env; outside Docker: pip install '.[{','.join(missing)}]'")
