"""NCCL between the trainer and vLLM images as the weight sync uses it (tools/nccl_check.py); `--full`: TRL's own
rendezvous and weight push against the running vllm (the sync-check command)."""

from __future__ import annotations


def run(rest: list[str]) -> int:
    if "--full" in rest:
        from tools.commands import sync_check

        return sync_check.run([])
    from tools import nccl_check

    return nccl_check.main(rest)
