"""Rehearse TRAIN_MODE=gpu on this CPU: the vLLM CPU twin as the vllm service, the trainer on CPU, weights by reload.
Extra arguments go to `trainer.launch`, as for `make train` (e.g. --max-steps 3)."""

from __future__ import annotations

from tools.commands.train import train
from tools.prepare import prepare


def run(rest: list[str]) -> int:
    return train(prepare(rehearse=True), rest)
