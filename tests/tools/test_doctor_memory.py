"""`make doctor`'s trainer-memory rows: the estimate (contract.memory) next to each trainer GPU's memory, and where
the host reads the model's config.json (a folder, or the stack's HF cache volume through a throw-away container)."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from contract.config import ColocateMode, GpuMode, train_mode_variant
from tools import derive, gpu_doctor
from tools.commands import doctor

QWEN3_06B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": True}
# Recorded `nvidia-smi --query-gpu=...` lines: 2 x H100 80GB, one 12 GB and one 24 GB card
TWO_H100 = gpu_doctor.parse_gpu_csv(
    "0, GPU-1b2c0c1e-1111-2222-3333-444444444444, NVIDIA H100 80GB HBM3, 81559, 0, 81008, 580.95.05\n"
    "1, GPU-9f0e7d6c-1111-2222-3333-555555555555, NVIDIA H100 80GB HBM3, 81559, 0, 81008, 580.95.05\n")
ONE_12GB = gpu_doctor.parse_gpu_csv(
    "0, GPU-aaaaaaaa-1111-2222-3333-444444444444, NVIDIA GeForce RTX 4070, 12282, 0, 12000, 580.95.05\n")
ONE_24GB = gpu_doctor.parse_gpu_csv(
    "0, GPU-bbbbbbbb-1111-2222-3333-444444444444, NVIDIA GeForce RTX 4090, 24564, 0, 24000, 580.95.05\n")


def rows_for(gpus, dotenv, mode_name, config=QWEN3_06B, where="test"):
    mode = train_mode_variant(mode_name)
    return gpu_doctor.memory_rows(gpus, dotenv, mode, derive.run_config(dotenv, mode), config, where)


def test_two_gpu_host_prints_the_breakdown_for_the_trainer_gpu_only_test_double_for_gpu_host():
    rows = rows_for(TWO_H100, {}, "gpu")
    assert [(ok, name) for ok, name, _ in rows] == [(True, "trainer memory GPU 1"),  # TRAINER_GPU=1 by default
                                                    (True, "trainer memory GPU 1 by method")]
    assert "0.60B params" in rows[0][2] and "GPU 1 has 81559 MiB" in rows[0][2] and "prompts assumed 512" in rows[0][2]
    assert rows[1][2].startswith("full 15.0 GiB fits; LoRA r=16 ") and "QLoRA r=16" in rows[1][2]


def test_lora_settings_are_sized_as_lora_and_an_8b_full_fine_tune_names_lora_test_double_for_gpu_host(monkeypatch):
    """#32 item 6: Qwen3-8B on one 80 GB trainer GPU: full fine-tuning does not fit and the line says LoRA would;
    LORA_R=16 fits."""
    from contract import memory

    monkeypatch.setattr(gpu_doctor, "model_config", lambda cfg: (memory.qwen3_config("Qwen3-8B"), "recorded"))
    full = rows_for(TWO_H100, {}, "gpu", config=memory.qwen3_config("Qwen3-8B"))
    fails = [msg for ok, _, msg in full if not ok]
    assert len(fails) == 1 and "LORA_R=16" in fails[0], full
    assert "full 145.1 GiB does not fit; LoRA r=16 39.0 GiB fits; QLoRA r=16 14.2 GiB fits" in full[1][2]
    lora = rows_for(TWO_H100, {"LORA_R": "16"}, "gpu", config=memory.qwen3_config("Qwen3-8B"))
    assert all(ok for ok, _, _ in lora) and "(lora r=16, " in lora[0][2], lora


def test_a_12_gb_card_colocated_fails_with_one_line_naming_what_to_change_test_double_for_gpu_host(capsys, monkeypatch):
    rows = rows_for(ONE_12GB, {}, "colocate")
    fails = [msg for ok, _, msg in rows if not ok]
    assert len(fails) == 1 and "\n" not in fails[0]
    assert "VLLM_GPU_MEMORY_UTILIZATION=0.3" in fails[0] and "a smaller model (MODEL_NAME)" in fails[0]
    # the same through `make doctor`'s own step, .env values typed by the host's one reader
    monkeypatch.setattr(gpu_doctor, "model_config", lambda cfg: (QWEN3_06B, "recorded"))
    assert doctor.trainer_memory(gpu_doctor.DockerGpus("CDI", ONE_12GB, "1 GPU"), {}, ColocateMode()) is False
    out = capsys.readouterr().out
    assert "ok   trainer memory GPU 0: 0.60B params" in out and "FAIL trainer memory GPU 0: the trainer needs" in out
    # a 24 GB card holds the same run colocated; the 12 GB one, with vLLM on a GPU of its own, holds LoRA (the full
    # fine-tune's 15 GiB counts vLLM's 2 GiB of packed push buffers and the autocast cache)
    assert all(ok for ok, _, _ in rows_for(ONE_24GB, {}, "colocate"))
    assert not all(ok for ok, _, _ in rows_for(ONE_12GB + TWO_H100[1:], {"VLLM_GPU": "1", "TRAINER_GPU": "0"}, "gpu"))
    assert all(ok for ok, _, _ in rows_for(ONE_12GB + TWO_H100[1:], {"VLLM_GPU": "1", "TRAINER_GPU": "0", "LORA_R": "16"},
                                           "gpu"))


def test_a_model_not_downloaded_yet_is_said_so_not_failed():
    where = "Qwen/Qwen3-0.6B not downloaded yet (`make up` downloads it)"
    rows = rows_for(TWO_H100, {}, "gpu", config=None, where=where)
    assert rows == [(True, "trainer memory", "not estimated: Qwen/Qwen3-0.6B not downloaded yet (`make up` downloads "
                     "it); the trainer's preflight prints it")]


def test_model_name_as_a_local_folder_is_read_from_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B))
    cfg = derive.run_config({"MODEL_NAME": str(tmp_path)}, GpuMode())
    assert gpu_doctor.model_config(cfg) == (QWEN3_06B, str(tmp_path))
    missing = derive.run_config({"MODEL_NAME": str(tmp_path / "nope")}, GpuMode())
    assert gpu_doctor.model_config(missing)[0] is None


@pytest.mark.docker
def test_config_json_is_read_from_the_hf_cache_volume_at_the_pinned_revision():
    """A real volume laid out as huggingface_hub's cache (what model-download writes), read by a throw-away
    container; a volume that does not exist is not created."""
    volume = f"grpo-test-hmaster-hf-{uuid.uuid4().hex[:8]}"
    rev = "c1899de289a04d12100db370d81485cdf75e47ca"
    cfg = derive.run_config({"MODEL_NAME": "Qwen/Qwen3-0.6B", "MODEL_REVISION": rev}, GpuMode())
    image = gpu_doctor.probe_image()
    try:
        assert gpu_doctor.model_config(cfg, volume=volume) == (
            None, "Qwen/Qwen3-0.6B not downloaded yet (`make up` downloads it)")
        assert subprocess.run(["docker", "volume", "inspect", volume], capture_output=True).returncode != 0
        d = "/c/hub/models--Qwen--Qwen3-0.6B"
        subprocess.run(["docker", "run", "--rm", "--user", "0", "-v", f"{volume}:/c", "-e",
                        f"CONFIG={json.dumps(QWEN3_06B)}", "--entrypoint", "sh", image, "-c",
                        f'mkdir -p {d}/snapshots/{rev} {d}/blobs {d}/refs && printf %s "$CONFIG" > {d}/blobs/abc && '
                        f'ln -s ../../blobs/abc {d}/snapshots/{rev}/config.json && printf %s {rev} > {d}/refs/main && '
                        'chmod -R a+rX /c'],
                       check=True, capture_output=True)
        config, where = gpu_doctor.model_config(cfg, volume=volume)
        assert config == QWEN3_06B and where == f"Qwen/Qwen3-0.6B@{rev[:12]} in volume {volume}"
        main = derive.run_config({"MODEL_NAME": "Qwen/Qwen3-0.6B", "MODEL_REVISION": "main"}, GpuMode())
        assert gpu_doctor.model_config(main, volume=volume)[0] == QWEN3_06B  # a branch: through refs/
        other = derive.run_config({"MODEL_NAME": "Qwen/Qwen3-0.6B", "MODEL_REVISION": "0" * 40}, GpuMode())
        assert gpu_doctor.model_config(other, volume=volume)[0] is None
    finally:
        subprocess.run(["docker", "volume", "rm", "-f", volume], capture_output=True)
