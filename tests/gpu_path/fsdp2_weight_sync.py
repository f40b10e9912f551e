"""TRL's weight-sync walk over an FSDP2 model, on CPU processes (gloo): run by test_gpu_layouts.py.

Shards the model as accelerate's FSDP2 plugin does with TRAINER_SHARDING=fsdp (`fully_shard` on each decoder
layer, then the root), then runs trl 1.16's own `VLLMGeneration.sync_weights` in server mode with the vLLM
client replaced by a recorder (test double for the NCCL broadcast). Rank 0 prints one JSON line: the model's
full parameter shapes, what the sync sent, and how many parameters were really sharded.

    python -m torch.distributed.run --nproc_per_node 2 tests/gpu_path/fsdp2_weight_sync.py MODEL_DIR
"""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from trl.generation.vllm_generation import VLLMGeneration


class RecordingClient:
    """Stands in for TRL's VLLMClient: keeps what update_named_params would broadcast."""

    sent: list = []

    def update_named_params(self, metadata, named_params):
        self.sent = [(name, list(param.shape)) for name, param in named_params]

    def reset_prefix_cache(self):
        pass


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    full = {name: list(p.shape) for name, p in model.named_parameters()}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = sum(list(p.to_local().shape) != full[name] for name, p in model.named_parameters())
    sync = object.__new__(VLLMGeneration)  # no server: set what sync_weights reads in server mode
    sync.__dict__.update(model=model, mode="server", enable_sleep_mode=False, _weight_metadata=None,
                         vllm_client=RecordingClient(), _dist=SimpleNamespace(is_fsdp=True, fsdp_version=2),
                         accelerator=SimpleNamespace(is_main_process=dist.get_rank() == 0, device=torch.device("cpu")))
    sync.sync_weights()
    if dist.get_rank() == 0:
        print(json.dumps({"full": full, "sent": sync.vllm_client.sent, "sharded": sharded,
                          "metadata": [[name, shape] for name, _, shape in sync._weight_metadata]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
