"""The trainer's GPU side: vLLM generation and NCCL weight sync (TRAIN_MODE gpu / colocate).

Light at import (standard library and pydantic only): `torch`, `vllm`, `trl` and `requests` load
inside the functions that need them, so CPU runs and the host's `make doctor` never import vLLM.

    grpo_kwargs  GRPOConfig kwargs per mode, and the line `make train` logs about it
    server       HTTP checks of the vLLM server (the calls TRL's client makes)
    nccl         NCCL settings of this process, the rendezvous address and port
    watchdog     a deadline around blocking NCCL calls, with a diagnosis instead of a hang
    trl_hooks    TRL's rendezvous and weight sync, wrapped: clear errors, timings, watchdog, pushes cast to
                 the served dtype
    server_checks  all of the above checked before GRPOTrainer is built (preflight_vllm)
    push_state   the weight-push marker: a run that left a push unfinished gets vLLM restarted before the next
    push_path    the weight push's path: what the sync trainer installs and what the checks push through
    weight_check does a push land

`make nccl-check FULL=1` (trainer.sync_check) and `make gpu-selfcheck` (trainer.gpu_selfcheck) are entrypoints at
trainer/'s root, above this package.
"""

from trainer.gpu.grpo_kwargs import describe_mode, grpo_vllm_kwargs
from trainer.gpu.server_checks import preflight_vllm
from trainer.gpu.server import VLLMPreflightError
from trainer.gpu.trl_hooks import instrument_weight_sync, push_in_served_dtype

__all__ = ["describe_mode", "grpo_vllm_kwargs", "instrument_weight_sync", "preflight_vllm", "push_in_served_dtype",
           "VLLMPreflightError"]
