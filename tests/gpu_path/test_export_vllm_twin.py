"""`vllm serve` on a `make export` folder: a real 1-step CPU run's checkpoint exported by trainer.export, mounted
read-only into the vLLM 0.31 CPU twin (the image the other twin tests build) with no flag but the folder, and asked
for a chat completion through the OpenAI route, built with the chat template the folder carries."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest
import requests

from tests.gpu_path.conftest import (VLLM_CPU_IMAGE, Twin, ensure_vllm_cpu_image, published_url, stop_twin,
                                     wait_until_healthy)

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1200)]

SERVED = "/models/export"


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir):
    from tests.trainer.conftest import EnvServer
    from trainer import train
    from trainer.after import export

    outputs = tmp_path_factory.mktemp("export-twin-run")
    server = EnvServer("echo", 16)
    try:
        assert train.main(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(outputs),
                           "--env-urls", f"echo={server.url}", "--run-name", "twin", "--max-steps", "1",
                           "--per-device-train-batch-size", "4", "--num-generations", "4",
                           "--max-completion-length", "32", "--trace-every", "0"]) == 0
    finally:
        server.stop()
    folder = tmp_path_factory.mktemp("exports") / "twin"
    assert export.main(["--outputs", str(outputs), "--run", "twin", "--out", str(folder)]) == 0
    folder.parent.chmod(0o755)  # pytest's tmp folders are private; the export itself is world-readable
    return folder


@pytest.fixture(scope="module")
def served(docker, exported):
    """`vllm serve FOLDER` as a user runs it (the twin's entrypoint is its `vllm serve`), as uid 10001 (not the
    folder's owner), on loopback only."""
    ensure_vllm_cpu_image()
    name = f"grpo-test-vllm-export-{uuid.uuid4().hex[:8]}"
    subprocess.run(["docker", "run", "-d", "--name", name, "--label", "grpo-test=1", "-p", "127.0.0.1::8000",
                    "--shm-size", "1g", "-v", f"{exported}:{SERVED}:ro", VLLM_CPU_IMAGE, SERVED],
                   check=True, capture_output=True)
    twin = Twin(name, published_url(name), [SERVED], 0.0)
    try:
        t0 = time.monotonic()
        wait_until_healthy(twin)
        print(f"\n[vllm-cpu] serving the export after {time.monotonic() - t0:.0f}s")
        yield twin.url
    finally:
        stop_twin(twin)


def test_vllm_serves_the_export_and_chats_with_its_template(served, exported):
    from transformers import AutoTokenizer

    assert requests.get(f"{served}/v1/models", timeout=30).json()["data"][0]["id"] == SERVED
    messages = [{"role": "user", "content": "Echo the word: hello"}]
    r = requests.post(f"{served}/v1/chat/completions", timeout=300, json={
        "model": SERVED, "messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert 1 <= body["usage"]["completion_tokens"] <= 4
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    # the prompt vLLM built is the one transformers builds from the folder's chat template, token for token
    tokenizer = AutoTokenizer.from_pretrained(exported)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert body["usage"]["prompt_tokens"] == len(prompt)
