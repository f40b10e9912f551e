"""GRPOConfig kwargs for vLLM generation per TRAIN_MODE, and the one line `make train` logs about it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from contract.config import RunConfig


# vLLM's OpenAI server fills every sampling field a request leaves out from the model's generation config
# (vllm 0.31 CompletionRequest.to_sampling_params: repetition/presence/frequency penalty, temperature, top_p/k, min_p;
# ModelConfig.get_diff_sampling_param, plus --override-generation-config). TRL's server client sends all of them but
# presence_penalty and frequency_penalty, while colocate builds SamplingParams whose defaults are 0: where the server
# has either as a default, server mode rolls out from another policy than the one trained (and biases the
# importance-sampling ratio). (vLLM reads generation_config.json through transformers' GenerationConfig, which in 5.17
# drops those two; an override flag or another transformers brings them back.) So the trainer sends them explicitly,
# in both modes, rather than relying on `--generation-config vllm` on the server: the sampling policy is set in one
# place, the trainer, whatever server it talks to. (That flag would keep the model's EOS ids: vLLM still reads them,
# InputProcessor.generation_config_fields.)
NEUTRAL_SAMPLING = {"presence_penalty": 0.0, "frequency_penalty": 0.0}


def grpo_vllm_kwargs(cfg: "RunConfig") -> dict[str, Any]:
    """GRPOConfig kwargs for vLLM generation. gpu -> `vllm_mode="server"` (the `vllm` service),
    colocate -> `vllm_mode="colocate"` (vLLM inside the trainer, one GPU, no vllm service),
    cpu -> `use_vllm=False`."""
    chosen = cfg.placement
    if not chosen.uses_vllm:
        return {"use_vllm": False}
    if chosen.server:
        return {
            "use_vllm": True,
            "vllm_mode": "server",
            "vllm_server_base_url": str(cfg.vllm_server_url).rstrip("/"),
            "vllm_server_timeout": float(cfg.vllm_server_timeout_s),
            "vllm_group_port": int(cfg.vllm_group_port),
            "generation_kwargs": dict(NEUTRAL_SAMPLING),
        }
    if chosen.colocated:
        kwargs: dict[str, Any] = {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": cfg.vllm_memory_share,
            "vllm_tensor_parallel_size": 1,
            "generation_kwargs": dict(NEUTRAL_SAMPLING),
        }
        if cfg.vllm_max_model_len:
            kwargs["vllm_max_model_length"] = int(cfg.vllm_max_model_len)
        from trainer.gpu.colocate import extra_flags  # VLLM_EXTRA_ARGS TRL takes as GRPOConfig fields (model impl, ...)

        kwargs.update(extra_flags(cfg)[1])
        return kwargs
    raise ValueError(f"TRAIN_MODE={chosen}: expected cpu, gpu or colocate (edit .env)")


def describe_mode(cfg: "RunConfig") -> str:
    """One line for `make train`'s log: which generation path this run uses."""
    chosen = cfg.placement
    if chosen.reload_dir:
        return (f"TRAIN_MODE=gpu: generating through the vLLM server at {cfg.vllm_server_url}, trainer on CPU, weights "
                f"pushed by a reload from {chosen.reload_dir} (WEIGHT_TRANSFER=reload: server mode rehearsed "
                "without GPUs)")
    if chosen.server:
        return (f"TRAIN_MODE=gpu: generating through the vLLM server at {cfg.vllm_server_url}, "
                f"weights synced over NCCL (trainer listens on port {cfg.vllm_group_port})")
    if chosen.colocated:
        return ("TRAIN_MODE=colocate: one GPU, vLLM runs inside the trainer process "
                f"(gpu_memory_utilization={cfg.vllm_memory_share}), no vllm service")
    return "TRAIN_MODE=cpu: transformers generation on the CPU, no vLLM"
