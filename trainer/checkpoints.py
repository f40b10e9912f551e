"""A run's checkpoints: which are complete, the last one (resume, eval and export default to it), and the one a user
names (`checkpoint-N`, `N` or a path)."""

from __future__ import annotations

import json
from pathlib import Path

PREFIX = "checkpoint-"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors")


class CheckpointError(RuntimeError):
    """One line: what is wrong and what to pick instead."""


def is_complete(path: Path) -> bool:
    # HF Trainer writes trainer_state.json last (after weights, optimizer, RNG): its presence marks a whole checkpoint.
    return any((path / n).exists() for n in WEIGHTS) and (path / "trainer_state.json").exists()


def step_of(path: Path) -> int:
    return int(json.loads((path / "trainer_state.json").read_text()).get("global_step", path.name[len(PREFIX):]))


def numbered(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's checkpoint folders by step, oldest first."""
    if not run_dir.is_dir():
        return []
    return sorted((int(p.name[len(PREFIX):]), p) for p in run_dir.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit())


def last_complete(run_dir: Path) -> tuple[Path | None, int, list[Path]]:
    """(last complete checkpoint, its global_step, incomplete checkpoints newer than it)."""
    incomplete = []
    for step, path in reversed(numbered(run_dir)):
        if is_complete(path):
            return path, step_of(path), incomplete
        incomplete.append(path)
    return None, 0, incomplete


def pick(run_dir: Path, checkpoint: str | None) -> tuple[Path, int]:
    """(checkpoint folder, its global step): the one named, else the last complete one."""
    have = f"checkpoints there: {', '.join(p.name for _, p in numbered(run_dir)) or 'none'}"
    if checkpoint is None:
        path, step, _ = last_complete(run_dir)
        if path is None:
            raise CheckpointError(f"run {run_dir.name} has no complete checkpoint yet ({have}); one is written every "
                                  "SAVE_STEPS steps and at the end of training")
        return path, step
    if "/" in checkpoint:
        path = Path(checkpoint)
    else:
        path = run_dir / (checkpoint if checkpoint.startswith(PREFIX) else f"{PREFIX}{checkpoint}")
    if not path.is_dir():
        raise CheckpointError(f"run {run_dir.name} has no {path.name} ({have}); pick one of them, or leave CHECKPOINT "
                              "empty for the last complete one")
    if not is_complete(path):
        raise CheckpointError(f"{path.name} of run {run_dir.name} is incomplete (cut short while saving); pick another "
                              f"({have})")
    return path, step_of(path)
