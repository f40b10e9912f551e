"""On the vLLM CPU twin (vLLM 0.31.0, the GPU service's flags), for real:
- `make nccl-check FULL=1`'s routine (trainer.sync_check, trainer.gpu.weight_check) through the rehearsal's
  reload path (WEIGHT_TRANSFER=reload: the trainer writes safetensors, vLLM reloads them; NCCL needs GPUs): perturbed
  weights change the served output and match the trainer's own forward, the originals pushed back give the same
  greedy tokens and the trainer's logprobs, and a layer that keeps its old tensors fails the check;
- issue #29 item 4: the tiny model's generation_config.json sets presence/frequency/repetition penalties (vLLM turns
  what it reads of them into server defaults); TRL's server-mode request with the trainer's GRPO settings samples
  with the trainer's unpenalised logprobs, while a request that leaves the fields out gets penalised ones.
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest

from tests.gpu_path.conftest import ensure_vllm_cpu_image, served_model, start_twin, stop_twin
from tests.helpers import commit_download_cache
from trainer.gpu import weight_check as wc
from trainer.core import grpo_args

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 1.0, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def penalised_model(tiny_model_dir, tmp_path_factory):
    """The CPU profile's tiny model, its generation_config.json setting penalties (EOS and the rest kept), stored in
    float16: vLLM serves a float32 checkpoint as bfloat16 on CPU, and vllm-cpu 0.31's bfloat16 path dies with SIGILL
    on this machine's CPUs (measured 2026-12-02: float32 and float16 serve, bfloat16 kills the worker on the first
    request); float16 is still a reduced precision vLLM serves, chosen by the model's config, not by another flag."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("penalised") / "tiny-qwen3"
    shutil.copytree(tiny_model_dir, out)
    # Untied: vLLM 0.31's layerwise reload leaves a TIED lm_head with its old weights ("ParallelLMHead: Failed to
    # load weights" in its log; this check found it: the rehearsal's reload push misses it). NCCL pushes go through
    # load_weights, where the tied head is the embedding. An untied copy of the same weights pushes every layer.
    tied = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = copy.deepcopy(tied.config)
    config.tie_word_embeddings = False
    untied = type(tied)(config)
    state = {**tied.state_dict(), "lm_head.weight": tied.get_input_embeddings().weight.detach().clone()}
    untied.load_state_dict(state)
    untied.to(torch.float16).save_pretrained(out)
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**gen, **PENALTIES}, indent=2))
    out.chmod(0o755)
    for p in out.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return out


@pytest.fixture(scope="module")
def twin(docker, gpu_config, penalised_model, tmp_path_factory):
    """The twin serving the penalised model, with a weights folder mounted at the same path as here (the trainer
    writes it, vLLM reads it: WEIGHT_RELOAD_DIR's contract)."""
    ensure_vllm_cpu_image()
    home = tmp_path_factory.mktemp("penalised-hf-home")  # served as the vllm service serves its model (conftest)
    commit_download_cache(home / "hub", penalised_model, *served_model(gpu_config))
    weights = tmp_path_factory.mktemp("reload-weights")
    # the twin runs as this test's uid: safetensors writes the pushed file 0600, and in the rehearsal the trainer and
    # vLLM containers share one uid (10001) the same way
    t = start_twin(gpu_config, home, docker_args=("-v", f"{weights}:{weights}:ro",
                                                             "--user", f"{os.getuid()}:{os.getgid()}"))
    try:
        yield t, weights
    finally:
        stop_twin(t)


@pytest.fixture
def reload_client(monkeypatch, trl_client_cls):
    """TRL's VLLMClient with the rehearsal's reload push; the class patches are undone after the test."""
    for attr in ("init_communicator", "update_named_params", "close_communicator", "reset_prefix_cache"):
        monkeypatch.setattr(trl_client_cls, attr, getattr(trl_client_cls, attr))
    return trl_client_cls


def test_sync_check_proves_the_pushed_weights_land__reload_path(twin, penalised_model, reload_client, capsys):
    from trainer import sync_check

    t, weights = twin
    rc = sync_check.run(t.url, str(penalised_model), 51216, 120, 300, reload_dir=str(weights))
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out + t.logs()[-3000:]
    assert "ok   weight push" in out and "prefix cache reset" in out
    assert "ok   weights land" in out
    assert "greedy tokens changed" in out or "perturbed push: served output moved" in out


def test_a_layer_that_keeps_its_old_weights_fails_the_check__reload_path(twin, penalised_model, reload_client):
    """The push leaves one tensor out (what vLLM does with a name it does not map): the served model then differs
    from the trainer's perturbed weights, and the check says so."""
    import requests
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.gpu.trl_hooks import use_weight_reload

    t, weights = twin
    use_weight_reload(str(weights), 300)
    client = reload_client(base_url=t.url)
    model = AutoModelForCausalLM.from_pretrained(penalised_model, dtype=torch.float32).eval()  # as the rehearsal's
    ids = AutoTokenizer.from_pretrained(penalised_model)(wc.PROBE_TEXT)["input_ids"]
    session = requests.Session()
    kept = "model.layers.0.self_attn.v_proj.weight"
    served_original = dict(model.named_parameters())[kept].detach().clone()

    def push_keeping_one_layer_old():  # the layer's tensor goes out unchanged: vLLM keeps the original there
        client.update_named_params(
            [], ((n, served_original if n == kept else p.data) for n, p in model.named_parameters()))

    try:
        with pytest.raises(wc.WeightCheckFailed, match="part of the perturbed push did not land") as failed:
            wc.check_weights_land(model, ids, push=push_keeping_one_layer_old, reset=client.reset_prefix_cache,
                                  ask=lambda: wc.query(session, t.url, t.model, ids))
        print(failed.value)
    finally:  # leave the twin serving the original weights
        client.update_model_params(AutoModelForCausalLM.from_pretrained(penalised_model, dtype=torch.float32))
        client.reset_prefix_cache()


def test_generation_config_penalties_do_not_change_server_mode_sampling(twin, penalised_model, trl_client_cls,
                                                                          tmp_path):
    """TRL's server-mode request (VLLMGeneration.generate's fields, from the trainer's GRPOConfig) against a model
    whose generation config sets penalties: the logprobs vLLM returns (processed_logprobs: after penalties) are the
    trainer's own unpenalised ones. A request that leaves the fields out gets the generation config's penalty (the
    control: the server does apply it). vLLM 0.31 reads generation_config.json through transformers'
    GenerationConfig, which keeps repetition_penalty but drops presence/frequency_penalty (transformers 5.17); those
    reach the server only through --override-generation-config, and the trainer sends them (0) all the same."""
    import requests
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contract.config import RunConfig
    from trainer.gpu.grpo_kwargs import grpo_vllm_kwargs

    t, _ = twin
    cfg = RunConfig(train_mode="gpu", model_name=str(penalised_model))
    args = grpo_args.grpo_config(cfg, output_dir=str(tmp_path), use_cpu=True, bf16=False, **grpo_vllm_kwargs(cfg))
    model = AutoModelForCausalLM.from_pretrained(penalised_model, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(penalised_model)(wc.PROBE_TEXT)["input_ids"]
    client = trl_client_cls(base_url=t.url)

    def gap_to_trainer(completions, logprobs):
        served, own = [], []
        for completion, lps in zip(completions, logprobs):
            seq = torch.tensor([[*ids, *completion]])
            with torch.no_grad():
                logits = model(input_ids=seq).logits[0, len(ids) - 1:-1].float() / args.temperature
            own += logits.log_softmax(-1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()
            served += [row[0] if isinstance(row, list) else row for row in lps]
        return wc.gap(served, own)

    # as trl's VLLMGeneration.generate sends them in server mode; ignore_eos only so that every completion is long
    out = client.generate([ids], n=4, repetition_penalty=args.repetition_penalty, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, min_p=args.min_p or 0.0, max_tokens=32, logprobs=0,
                          generation_kwargs={**args.generation_kwargs, "ignore_eos": True})
    trained = gap_to_trainer(out["completion_ids"], out["logprobs"])
    bare = requests.post(f"{t.url}/v1/completions", timeout=120, json={
        "model": t.model, "prompt": ids, "n": 4, "temperature": args.temperature, "max_tokens": 32,
        "logprobs": 0, "ignore_eos": True, "return_token_ids": True}).json()["choices"]
    control = gap_to_trainer([c["token_ids"] for c in bare], [c["logprobs"]["token_logprobs"] for c in bare])
    print(f"\nserved vs trainer logprobs: the trainer's request {trained}; fields left out {control}")
    assert args.generation_kwargs == {"presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert trained.matches(), trained
    assert not control.matches(), f"the generation config's repetition_penalty did not act ({control})"
