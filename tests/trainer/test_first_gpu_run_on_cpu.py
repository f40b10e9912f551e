"""What would break a first GPU run, caught on the CPU: thinking off in the prompts TRL generates from,
prompt + completion lengths against vLLM's limit, the pinned model revision, the chat-template check
of the downloaded model, and the stage lines `make gpu-smoke` reads. All with the tiny model, whose
chat template is Qwen3's (the one TRL recognises)."""

from __future__ import annotations

import json
import shutil

import pytest

from trainer.run import preflight
from contract import stages
from contract.config import CpuMode, GpuMode, RunConfig
from trainer.download_model import check_downloaded
from tests.helpers import commit_download_cache
from trainer.core import grpo_args

THINK_OFF_SUFFIX = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def cfg_for(model_dir, url, *extra: str) -> RunConfig:
    return RunConfig.load(["--train-mode", "cpu", "--model-name", str(model_dir), "--env-name", "echo",
                           "--env-urls", f"echo={url}", "--output-dir", "/tmp/unused", *extra])


def rendered_generation_prompt(cfg: RunConfig, echo_server) -> str:
    """The first prompt exactly as GRPOTrainer tokenizes it for generation (its own _tokenize_prompts)."""
    from envs import registry
    from trainer.run.dataset import build_dataset
    from trainer.modeling.model import load_model_and_tokenizer
    from trainer.run.grpo_trainer import make_trainer_class
    from trainer.rollouts.envs_binding import build_factories
    from trainer.core.metrics import STATS

    model, tokenizer = load_model_and_tokenizer(cfg.resolved(CpuMode()))
    specs = {"echo": registry.get("echo")}
    trainer_cls = make_trainer_class()
    trainer = trainer_cls(model=model, args=grpo_args.grpo_config(cfg.resolved(CpuMode())), train_dataset=build_dataset(cfg, specs),
                          processing_class=tokenizer, environment_factory=build_factories(cfg, specs, STATS))
    trainer._batch_environments = list(trainer._env_tools)[:1]  # what TRL sets per batch (one env here)
    prompt = trainer.train_dataset[0]["prompt"]
    ids = trainer._tokenize_prompts([prompt])[0][0]
    return tokenizer.decode(ids)


def test_thinking_is_off_by_default_in_the_prompt_trl_generates_from(tmp_path, tiny_model_dir, echo_server):
    cfg = cfg_for(tiny_model_dir, echo_server.url, "--output-dir", str(tmp_path))
    assert cfg.enable_thinking is False and grpo_args.grpo_config(cfg.resolved(CpuMode())).chat_template_kwargs == {"enable_thinking": False}
    text = rendered_generation_prompt(cfg, echo_server)
    assert text.endswith(THINK_OFF_SUFFIX)  # the model starts after an empty think block: straight to the tool call
    assert "<tools>" in text and '"type": "function"' in text  # rendered with the env's tools


def test_enable_thinking_true_leaves_the_model_to_think(tmp_path, tiny_model_dir, echo_server, monkeypatch):
    monkeypatch.setenv("ENABLE_THINKING", "true")
    cfg = cfg_for(tiny_model_dir, echo_server.url, "--output-dir", str(tmp_path))
    text = rendered_generation_prompt(cfg, echo_server)
    assert text.endswith("<|im_start|>assistant\n") and not text.endswith(THINK_OFF_SUFFIX)


def test_lengths_that_do_not_fit_vllms_max_model_len_stop_preflight_with_both_numbers(tiny_model_dir, echo_server):
    from envs import registry
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    specs = {"echo": registry.get("echo")}
    prompt, env = preflight.longest_prompt(cfg_for(tiny_model_dir, echo_server.url), tokenizer, specs)
    limit = prompt + 16  # the tiny tokenizer's prompt fits alone, not with a 32-token budget
    cfg = cfg_for(tiny_model_dir, echo_server.url, "--vllm-max-model-len", str(limit), "--max-completion-length", "32")
    assert env == "echo" and preflight.longest_prompt(cfg, tokenizer, specs) == (prompt, env)
    errors, fits = preflight.check_lengths(cfg.resolved(GpuMode()), tokenizer, specs)
    assert fits == "" and len(errors) == 1
    assert (f"longest prompt {prompt} tokens (env echo, rendered with its tools) + MAX_COMPLETION_LENGTH 32 = "
            f"{prompt + 32} > VLLM_MAX_MODEL_LEN {limit}") in errors[0]
    assert f"lower MAX_COMPLETION_LENGTH to <= {limit - prompt}" in errors[0]
    ok = cfg_for(tiny_model_dir, echo_server.url, "--vllm-max-model-len", "4096")
    assert preflight.check_lengths(ok.resolved(GpuMode()), tokenizer, specs) == ([], f"lengths: longest prompt {prompt} tokens "
                                                                    "(env echo, rendered with its tools) + "
                                                                    "MAX_COMPLETION_LENGTH 256 = "
                                                                    f"{prompt + 256} <= VLLM_MAX_MODEL_LEN 4096")
    # Server mode: what the server reports wins (VLLM_MAX_MODEL_LEN may be unset, the service's default applies)
    errors, _ = preflight.check_lengths(ok.resolved(GpuMode()), tokenizer, specs, server_max_model_len=limit)
    assert f"> the vLLM server's max_model_len {limit}" in errors[0]
    # CPU generation is bounded by the model itself (TRL checks the same limit)
    errors, fits = preflight.check_lengths(cfg.resolved(CpuMode()), tokenizer, specs)
    assert not errors and "max_position_embeddings" in fits


def test_model_revision_reaches_every_loader_of_a_hub_model_but_not_a_local_folder(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("MODEL_REVISION", "c1899de289a04d12100db370d81485cdf75e47ca")
    hub = RunConfig.load(["--model-name", "Qwen/Qwen3-0.6B", "--train-mode", "gpu"])
    assert hub.model_load_kwargs == {"revision": "c1899de289a04d12100db370d81485cdf75e47ca"}
    local = RunConfig.load(["--model-name", str(tiny_model_dir), "--train-mode", "cpu"])
    assert local.model_load_kwargs == {}


def test_downloaded_model_chat_template_is_checked_before_vllm_starts(tmp_path, tiny_model_dir):
    assert check_downloaded(str(tiny_model_dir), "tiny") == []
    unknown = tmp_path / "unknown-template"
    shutil.copytree(tiny_model_dir, unknown)
    config = json.loads((unknown / "tokenizer_config.json").read_text())
    # a hub revision whose template TRL does not recognise (one character differs from Qwen3's)
    template = (unknown / "chat_template.jinja") if (unknown / "chat_template.jinja").exists() else None
    if template is not None:
        template.write_text(template.read_text().replace("<tool_call>\\n", "<tool_call> \\n", 1) + " ")
    else:
        config["chat_template"] = config["chat_template"] + " "
        (unknown / "tokenizer_config.json").write_text(json.dumps(config))
    problems = check_downloaded(str(unknown), "org/model")
    assert len(problems) == 1 and problems[0].startswith("MODEL_NAME=org/model:")


def test_stage_lines_are_printed_once_and_parsed_back(capsys, monkeypatch):
    monkeypatch.setattr(stages, "_seen", set())
    assert stages.mark("rendezvous", 1.234, "group formed") is True
    assert stages.mark("rendezvous", 9.0, "again") is False
    stages.mark("tool_calls", None, "1.50 per episode", value=1.5)
    found = stages.parse("noise\n" + capsys.readouterr().out + "trainer-1  | [stage] {broken")
    assert found["rendezvous"] == {"stage": "rendezvous", "seconds": 1.23, "detail": "group formed"}
    assert found["tool_calls"]["value"] == 1.5


@pytest.mark.parametrize("env_value,expected", [("", False), ("false", False), ("1", True), ("true", True)])
def test_enable_thinking_reads_the_env_file_values(monkeypatch, env_value, expected):
    monkeypatch.setenv("ENABLE_THINKING", env_value)
    assert RunConfig.load([]).enable_thinking is expected


def test_a_pinned_revision_loads_offline_from_a_commit_download(tiny_model_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants
    from huggingface_hub import try_to_load_from_cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contract import config

    commit = "c1899de289a04d12100db370d81485cdf75e47ca"
    snapshot = commit_download_cache(tmp_path / "hub", tiny_model_dir, "Qwen/Qwen3-0.6B", commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    config.local_snapshot.cache_clear()
    # The blocker: a load by name and no revision looks up refs/main, which a commit download never writes.
    assert not (snapshot.parents[1] / "refs").exists()
    assert try_to_load_from_cache("Qwen/Qwen3-0.6B", "config.json", cache_dir=str(tmp_path / "hub")) is None

    monkeypatch.setenv("MODEL_REVISION", commit)
    cfg = RunConfig.load(["--model-name", "Qwen/Qwen3-0.6B", "--train-mode", "gpu"])
    assert cfg.model_path == str(snapshot) and cfg.model_load_kwargs == {}
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path)
    assert model.name_or_path == str(snapshot)  # what TRL colocate hands to vLLM's LLM(model=...)
    assert AutoTokenizer.from_pretrained(cfg.model_path).eos_token == "<|im_end|>"

    # Not downloaded yet (another revision): by name, with the revision, as before.
    config.local_snapshot.cache_clear()
    monkeypatch.setenv("MODEL_REVISION", "0" * 40)
    other = RunConfig.load(["--model-name", "Qwen/Qwen3-0.6B", "--train-mode", "gpu"])
    assert other.model_path == "Qwen/Qwen3-0.6B" and other.model_load_kwargs == {"revision": "0" * 40}
    config.local_snapshot.cache_clear()
