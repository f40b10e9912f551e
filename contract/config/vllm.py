"""The vLLM side of a run (gpu and colocate modes): where the server is, how long its answers may take, its memory."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlparse

from pydantic import AfterValidator, BaseModel, Field, field_validator

from contract import vllm_flags


class VllmSettings(BaseModel):
    """vLLM's server, rendezvous, timeouts and memory."""

    vllm_server_url: str = Field("http://vllm:8000", description="vLLM server (gpu mode).")
    vllm_group_port: int = Field(51216, ge=1, le=65535, description="Port the trainer listens on for the NCCL rendezvous.")
    vllm_server_timeout_s: float = Field(240.0, gt=0, description="How long to wait for the vLLM server to be healthy.")
    weight_sync_timeout_s: float = Field(300.0, gt=0, description="Fail a weight sync that takes longer (with a diagnosis).")
    generation_timeout_s: float = Field(
        600.0, gt=0, description="Server mode: fail a generation request to vLLM that takes longer (vLLM hung?), with "
        "a diagnosis (exit 75), instead of waiting forever. ROLLOUTS=async: the trainer waits at most this long for "
        "a sample, then says why (vLLM paused or stuck: exit 77, restarted and resumed; still generating: it waits on)."
    )
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM's GPU memory share. Empty: "
                                                      "0.9 (gpu, own GPU), 0.3 (colocate).")
    vllm_max_model_len: int | None = Field(None, ge=64, description="vLLM max model length (prompt + completion).")
    vllm_extra_args: Annotated[str, AfterValidator(vllm_flags.checked)] = Field("", description="Extra `vllm serve` flags, "
        "e.g. `--no-async-scheduling`: the vllm service, its CPU twin, colocate's engine (contract/vllm_flags.py).")
    vllm_world_size: int = Field(1, ge=1, description="vLLM workers that join the weight sync (tensor x data "
                                 "parallel); set by `make` from VLLM_GPU and VLLM_PARALLEL, checked against the "
                                 "server's /get_world_size.")

    @field_validator("vllm_server_url")
    @classmethod
    def _check_vllm_url(cls, value: str) -> str:
        parsed = urlparse(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{value!r} is not a URL; write e.g. http://vllm:8000 (edit .env)")
        return value.rstrip("/")

    @property
    def vllm_memory_share(self) -> float:
        """VLLM_GPU_MEMORY_UTILIZATION, else the resolved mode's default (0.9 on a GPU of its own, 0.3 colocated)."""
        return float(self.vllm_gpu_memory_utilization or self.placement.vllm_memory_share)  # type: ignore[attr-defined]
