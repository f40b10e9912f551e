"""LoRA on the vLLM 0.31 CPU twin (#32 items 4 and 5): the twin serves LoRA adapters. A real LoRA CPU run's adapter,
exported by `make export EXPORT_ADAPTER=1`, is served by `vllm serve BASE --enable-lora --lora-modules`, loads again
at run time through `/v1/load_lora_adapter` (the route TRL's async trainer syncs adapters by), and changes the served
output; the default export (base + adapter merged, a `make export` folder) served on its own, mounted read-only and
read as uid 10001 (not the folder's owner), gives the same log-probs as base + adapter, and chats through the OpenAI
route with the chat template the folder carries."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest
import requests

from tests.gpu_path.conftest import VLLM_CPU_IMAGE, Twin, ensure_vllm_cpu_image, published_url, stop_twin, \
    wait_until_healthy

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1500)]

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
# fp32 on the twin: the adapter of a short run moves log-probs by less than bf16 resolves
SERVE_FLAGS = ["--dtype=float32", "--max-model-len=512", "--enforce-eager"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_model_dir):
    """A 3-step LoRA run on the tiny model (CPU profile), exported merged (default) and as the adapter alone."""
    from tests.trainer.conftest import EnvServer
    from trainer import train
    from trainer.after import export

    outputs = tmp_path_factory.mktemp("lora-twin-run")
    server = EnvServer("echo", 16)
    try:
        assert train.main(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(outputs),
                           "--env-urls", f"echo={server.url}", "--run-name", "lora", "--max-steps", "3",
                           "--lora-r", "8", "--per-device-train-batch-size", "8", "--num-generations", "8",
                           "--max-completion-length", "48", "--trace-every", "0"]) == 0
    finally:
        server.stop()
    root = tmp_path_factory.mktemp("lora-exports")
    assert export.main(["--outputs", str(outputs), "--run", "lora", "--out", str(root / "merged")]) == 0
    assert export.main(["--outputs", str(outputs), "--run", "lora", "--out", str(root / "adapter"), "--adapter"]) == 0
    for p in [root, *root.rglob("*")]:  # the twin runs as uid 10001
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


def start(model_dir, mounts: dict[str, str], *flags: str, env: tuple[str, ...] = ()) -> Twin:
    ensure_vllm_cpu_image()
    name = f"grpo-test-lora-twin-{uuid.uuid4().hex[:8]}"
    volumes = [arg for src, dst in mounts.items() for arg in ("-v", f"{src}:{dst}:ro")]
    environment = [arg for e in env for arg in ("-e", e)]
    subprocess.run(["docker", "run", "-d", "--name", name, "--label", "grpo-test=1", "-p", "127.0.0.1::8000",
                    "--shm-size", "1g", *volumes, *environment, VLLM_CPU_IMAGE, model_dir, *SERVE_FLAGS, *flags],
                   check=True, capture_output=True)
    return Twin(name, published_url(name), [model_dir], 0.0)


def healthy(twin: Twin, since: float) -> None:
    wait_until_healthy(twin)
    print(f"\n[vllm-cpu] {twin.command[0]} healthy {time.monotonic() - since:.0f}s after its start")


def logprobs(twin: Twin, model: str) -> list[float]:
    r = requests.post(f"{twin.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text[:500]
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


def test_the_twin_serves_the_adapter_at_start_and_by_load_lora_adapter_and_the_merged_export_matches(
        docker, tiny_model_dir, exports):
    # both twins start at once: their cold starts (mostly one core each) overlap instead of following each other
    t0 = time.monotonic()
    twin = start("/models/base", {str(tiny_model_dir): "/models/base", str(exports / "adapter"): "/adapters/lora"},
                 "--enable-lora", "--max-lora-rank=8", "--lora-modules", "lora=/adapters/lora",
                 env=("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",))
    merged = start("/models/merged", {str(exports / "merged"): "/models/merged"})
    try:
        healthy(twin, t0)
        base = logprobs(twin, "/models/base")
        adapted = logprobs(twin, "lora")
        assert requests.post(f"{twin.url}/v1/completions", timeout=60, json={
            "model": "pushed", "prompt": PROMPT, "max_tokens": 2}).status_code == 404  # not loaded yet
        r = requests.post(f"{twin.url}/v1/load_lora_adapter", timeout=120,
                          json={"lora_name": "pushed", "lora_path": "/adapters/lora"})
        assert r.status_code == 200, r.text[:500]
        pushed = logprobs(twin, "pushed")
        stop_twin(twin)
        healthy(merged, t0)
        served_merged = logprobs(merged, "/models/merged")
        chat = chat_through_the_folders_template(merged, "/models/merged")
    finally:
        stop_twin(twin)
        stop_twin(merged)
    print(f"base {base}\nbase + adapter {adapted}")
    assert adapted != base, "the adapter did not change the served output"
    assert pushed == pytest.approx(adapted, abs=1e-5)  # loaded at run time = loaded at start
    print(f"merged export {served_merged}")
    assert served_merged == pytest.approx(adapted, abs=1e-3)  # base + adapter == the merged standalone folder
    assert 1 <= chat["usage"]["completion_tokens"] <= 4
    assert chat["choices"][0]["finish_reason"] in ("length", "stop")
    # the prompt vLLM built is the one transformers builds from the folder's chat template, token for token
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(exports / "merged").apply_chat_template(
        CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert chat["usage"]["prompt_tokens"] == len(prompt)


CHAT = [{"role": "user", "content": "Echo the word: hello"}]


def chat_through_the_folders_template(twin: Twin, model: str) -> dict:
    """A chat completion through the OpenAI route: vLLM renders CHAT with the chat template the served folder holds."""
    assert requests.get(f"{twin.url}/v1/models", timeout=30).json()["data"][0]["id"] == model
    r = requests.post(f"{twin.url}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": CHAT, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text[:500]
    return r.json()
