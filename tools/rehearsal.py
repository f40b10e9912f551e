"""`make rehearse`: TRAIN_MODE=gpu's topology on CPU, as what the generated compose file changes (pure, no Docker).

The same services as on a GPU host (`vllm`, `trainer`, the env servers of .env), health-gated the same way; what
differs, each for want of a GPU:
  * `vllm` runs the vLLM CPU twin image (same release, same `vllm serve` flags and dev routes) on the tiny model
    that the CPU profile's `model-init` makes, instead of MODEL_NAME from the Hub;
  * `trainer` runs the GPU trainer's Dockerfile built on the twin (`trainer-rehearse-image`), on CPU, and pushes
    weights by WEIGHT_TRANSFER=reload through a `weights` volume both mount, instead of an NCCL broadcast;
  * neither reserves a GPU, and `model-download` (the Hub) is not needed;
  * REHEARSE_VLLM_CPUSET and REHEARSE_TRAINER_CPUSET (environment variables, e.g. 0 and 1) put the twin and the
    trainer on CPU sets of their own, so generation and training overlap as on two GPUs (`make bench-async`).
With LORA_R and ROLLOUTS=async nothing here changes: the adapter goes by TRL's own sync (a folder on the outputs
volume and /v1/load_lora_adapter) exactly as on a GPU host, and the twin gets the vllm service's LoRA flags from the
same place (tools/compose_file.add_lora_serving).
"""

from __future__ import annotations

from tools.compose_file import Override, OverrideMap, Reset
from tools.images import TRAINER_REHEARSE_BUILD, TWIN_BUILD, image_ref
from contract.config import CPU_DEFAULT_MODEL, default

BUILD_PROFILES = ("vllm-cpu", "build-rehearse")  # the twin's (TWIN_BUILD) and the rehearsal trainer's
PROFILE = "rehearse"              # model-init joins it: the twin serves the model it makes
WEIGHTS_VOLUME = "weights"       # compose.yaml's (tmpfs, uid 10001)


def weights_dir() -> str:
    """Where trainer and twin mount the weights volume: the trainer's own WEIGHT_RELOAD_DIR default."""
    return default("weight_reload_dir")


def services(env_depends: dict[str, dict]) -> dict[str, dict]:
    """The generated compose file's part for the rehearsal; `env_depends`: the trainer's depends_on the env services
    (tools/compose_file.env_services), kept when the rehearsal replaces the trainer's depends_on (no model-download)."""
    healthy = {"condition": "service_healthy"}
    weights = weights_dir()
    return {
        "model-init": {"profiles": Override(["cpu", PROFILE])},
        "vllm": {
            "image": image_ref(TWIN_BUILD),
            "entrypoint": ["vllm-serve", CPU_DEFAULT_MODEL],   # the twin's `vllm serve` (services/vllm-cpu/vllm-serve)
            "environment": {"VLLM_CPU_KVCACHE_SPACE": "${VLLM_CPU_KVCACHE_SPACE:-1}"},
            # the tiny model, and the trainer's pushes; no Hub cache (nothing is downloaded)
            "volumes": Override(["models:/models:ro", f"{WEIGHTS_VOLUME}:{weights}:ro"]),
            "mem_limit": "${VLLM_CPU_MEM_LIMIT:-6g}",
            # two emulated devices: the twin and the trainer on CPU sets of their own (empty: every core for both)
            "cpuset": "${REHEARSE_VLLM_CPUSET:-}",
            "shm_size": "1g",
            "deploy": Reset(),
            "depends_on": OverrideMap({"model-init": {"condition": "service_completed_successfully"}}),
        },
        "trainer": {
            "image": image_ref(TRAINER_REHEARSE_BUILD),
            "environment": {"TRAIN_MODE": "gpu", "WEIGHT_TRANSFER": "reload", "WEIGHT_RELOAD_DIR": weights,
                            "MODEL_NAME": CPU_DEFAULT_MODEL, "MODEL_REVISION": ""},
            "volumes": ["models:/models:ro", f"{WEIGHTS_VOLUME}:{weights}"],
            "mem_limit": "${TRAINER_CPU_MEM_LIMIT:-8g}",
            "cpuset": "${REHEARSE_TRAINER_CPUSET:-}",
            "deploy": Reset(),
            "depends_on": OverrideMap({**env_depends, "vllm": healthy}),
        },
    }

