"""run.json in the run folder: what a run was trained from and with, written by each training session's start
(rank 0) for what reads the run later (`make export`'s model card). The latest session's settings win.

{"base_model": str, "model_revision": str | null, "base_dtype": str | null, "mode": str, "envs": [str, ...],
 "learning_rate": float, "settings": {RunConfig field: value, ...}, "written": ISO time}
base_dtype: the dtype the base model is published in (its config.json); training keeps fp32 master weights, so
checkpoints are fp32 and `make export` writes the weights back in this dtype.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

RUN_INFO_FILE = "run.json"
# Addresses (env servers, vLLM, trackers) say nothing about the model and may carry credentials: left out.
ADDRESS = re.compile(r"_(url|urls|uri)$")


def write(cfg, base_dtype: str | None = None) -> Path:
    path = Path(cfg.run_dir) / RUN_INFO_FILE
    info = {"base_model": cfg.model_id, "model_revision": cfg.model_revision,
            "base_dtype": base_dtype, "mode": cfg.placement.name,
            "envs": cfg.env_names, "learning_rate": cfg.effective_learning_rate,
            "settings": cfg.model_dump(mode="json", exclude=set(filter(ADDRESS.search, type(cfg).model_fields))),
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(path)  # a reader never sees half a file
    return path


def read(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / RUN_INFO_FILE
    return json.loads(path.read_text()) if path.exists() else None
