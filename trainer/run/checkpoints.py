"""A run's checkpoints: which are complete, the last one (resume, eval and export default to it), the one a user
names (`checkpoint-N`, `N`, `best` or a path), and `checkpoint-best`, the best by the evaluation during training
(EVAL_EVERY: trainer.run.evaluation): the files of that step's checkpoint hard-linked, so that checkpoint's rotation
does not take them; transformers' rotation (3 folders kept) spares checkpoint-best itself, one of the 3, as its state's
best_model_checkpoint. Never resumed from.

Complete means: the trainer wrote MARKER last, after every file of the folder and the folder itself were fsynced
(`seal`, from the trainer's on_save), and trainer_state.json parses. A host crash or a full disk mid-save leaves a
folder without it (or with an empty trainer_state.json): resume, eval and export fall back to the previous complete
one with one line. Checkpoints older than the run's first marked one were saved before markers existed: for them
the old rule holds (weights there and a trainer_state.json that parses).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

PREFIX = "checkpoint-"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors")
MARKER = "checkpoint-complete.json"
BEST = f"{PREFIX}best"
BEST_NOTE = "best-eval.json"  # in checkpoint-best: {"step", "reward"}, what made it the best
OPTIMIZER_FACTOR = 2  # AdamW keeps two fp32 moments per parameter (save-size estimate before the first checkpoint)


class CheckpointError(RuntimeError):
    """One line: what is wrong and what to pick instead."""


def _state(path: Path) -> dict | None:
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def why_incomplete(path: Path) -> str | None:
    """None for a complete checkpoint, else why not (for a log line)."""
    marked = (path / MARKER).exists()
    if not marked and _marked_before(path):
        return "it was cut short while saving (no completion marker)"
    if not marked and not any((path / n).exists() for n in WEIGHTS):
        return "it has no weights (cut short while saving)"
    if not (path / "trainer_state.json").exists():
        return "it has no trainer_state.json (cut short while saving)"
    if _state(path) is None:
        return "its trainer_state.json is empty or unreadable (a full disk or a crash while saving)"
    return None


def is_complete(path: Path) -> bool:
    return why_incomplete(path) is None


def _marked_before(path: Path) -> bool:
    """Whether a checkpoint of the same run older than `path` carries the marker (so `path` should too)."""
    try:
        step = int(path.name[len(PREFIX):])
    except ValueError:
        return False
    return any((p / MARKER).exists() for s, p in numbered(path.parent) if s < step)


def step_of(path: Path) -> int:
    state = _state(path) or {}
    return int(state.get("global_step", path.name[len(PREFIX):]))


def numbered(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's checkpoint folders by step, oldest first."""
    if not run_dir.is_dir():
        return []
    return sorted((int(p.name[len(PREFIX):]), p) for p in run_dir.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit())


def last_complete(run_dir: Path) -> tuple[Path | None, int, list[tuple[Path, str]]]:
    """(last complete checkpoint, its global_step, [(incomplete checkpoint newer than it, why)])."""
    incomplete = []
    for step, path in reversed(numbered(run_dir)):
        why = why_incomplete(path)
        if why is None:
            return path, step_of(path), incomplete
        incomplete.append((path, why))
    return None, 0, incomplete


def pick(run_dir: Path, checkpoint: str | None) -> tuple[Path, int]:
    """(checkpoint folder, its global step): the one named, else the last complete one."""
    have = f"checkpoints there: {', '.join(p.name for _, p in numbered(run_dir)) or 'none'}"
    if checkpoint is None:
        path, step, skipped = last_complete(run_dir)
        if path is None:
            raise CheckpointError(f"run {run_dir.name} has no complete checkpoint yet ({have}); one is written every "
                                  "SAVE_STEPS steps and at the end of training")
        for newer, why in skipped:
            print(f"[checkpoints] skipping {newer.name} of run {run_dir.name}: {why}; using {path.name}",
                  file=sys.stderr, flush=True)
        return path, step
    if "/" in checkpoint:
        path = Path(checkpoint)
    else:
        path = run_dir / (checkpoint if checkpoint.startswith(PREFIX) else f"{PREFIX}{checkpoint}")
    if not path.is_dir():
        why = " (the evaluation during training writes it: EVAL_EVERY in .env)" if path.name == BEST else ""
        raise CheckpointError(f"run {run_dir.name} has no {path.name}{why} ({have}); pick one of them, or leave "
                              "CHECKPOINT empty for the last complete one")
    why = why_incomplete(path)
    if why is not None:
        raise CheckpointError(f"{path.name} of run {run_dir.name} is incomplete: {why}; pick another ({have})")
    return path, step_of(path)


# ---------------------------------------------------------------------------- writing (the trainer's rank 0)
def _fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(path: Path, step: int) -> None:
    """Mark a saved checkpoint complete: fsync its files and folders, then write MARKER (temp, fsync, rename) and
    fsync the folder again, so the marker cannot reach the disk before what it vouches for."""
    folders = [path] + [p for p in path.rglob("*") if p.is_dir()]
    for p in path.rglob("*"):
        if p.is_file():
            _fsync(p)
    for d in folders:
        _fsync(d, directory=True)
    tmp = path / f".{MARKER}.tmp"
    with open(tmp, "w") as f:
        json.dump({"global_step": step, "files": sorted(str(p.relative_to(path)) for p in path.rglob("*")
                                                        if p.is_file() and p != tmp)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path / MARKER)
    _fsync(path, directory=True)
    _fsync(path.parent, directory=True)  # the checkpoint folder's own entry in the run folder


def keep_as_best(ckpt: Path, step: int, note: dict) -> Path:
    """`ckpt` (just saved) as the run's checkpoint-best: its files hard-linked (copied where the filesystem has no hard
    links) but the per-process RNG states, `note` beside them, sealed, then swapped in for the previous best."""
    run_dir = ckpt.parent
    best, tmp, old = run_dir / BEST, run_dir / f".{BEST}.tmp", run_dir / f".{BEST}.old"
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(ckpt, tmp, copy_function=_link, ignore=shutil.ignore_patterns("rng_state*", MARKER))
    (tmp / BEST_NOTE).write_text(json.dumps(note))
    (tmp / BEST_NOTE).chmod(0o644)
    seal(tmp, step)
    if best.exists():
        os.replace(best, old)
    os.replace(tmp, best)
    shutil.rmtree(old, ignore_errors=True)
    return best


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def best_note(run_dir: Path) -> dict | None:
    """What made the run's checkpoint-best the best ({"step", "reward"}), or None when it has none (complete)."""
    best = Path(run_dir) / BEST
    try:
        note = json.loads((best / BEST_NOTE).read_text()) if is_complete(best) else None
    except (OSError, ValueError):
        return None
    return note if isinstance(note, dict) and isinstance(note.get("reward"), (int, float)) else None


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def save_estimate(run_dir: Path, parameter_bytes: int, save_only_model: bool = False) -> int:
    """Bytes the next save needs: the last complete checkpoint's size, else the model's parameters plus the
    optimizer's state (OPTIMIZER_FACTOR times the parameters) unless only the model is saved."""
    last, _, _ = last_complete(run_dir)
    if last is not None:
        return size_of(last)
    return parameter_bytes * (1 + (0 if save_only_model else OPTIMIZER_FACTOR))


def check_free_space(run_dir: Path, needed: int) -> None:
    """Raise CheckpointError when the run folder's filesystem has less free than `needed` bytes."""
    free = shutil.disk_usage(run_dir).free
    if free < needed:
        raise CheckpointError(f"not enough disk for the next checkpoint in {run_dir}: it needs about "
                              f"{_gib(needed)}, {_gib(free)} is free; free space there (or delete old runs' "
                              "checkpoints), then run again to resume from the last checkpoint")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
