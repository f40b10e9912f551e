"""The training prompts: each env's rows, routed by an `environment` column when several envs train together."""

from __future__ import annotations

from contract.config import RunConfig


def build_dataset(cfg: RunConfig, specs: dict):
    """Rows from each env's make_dataset; multi-env rows carry an `environment` column (TRL routes on it)."""
    from datasets import Dataset

    from trainer.rollouts.envs_binding import encode_row

    multi = len(cfg.env_names) > 1
    rows = []
    for i, name in enumerate(cfg.env_names):
        spec = specs[name]
        for row in spec.make_dataset(cfg.dataset_size, cfg.seed + i):
            enc = encode_row(dict(row))
            if multi:
                enc["environment"] = name
            rows.append(enc)
    ds = Dataset.from_list(rows)
    return ds.shuffle(seed=cfg.seed) if multi else ds
