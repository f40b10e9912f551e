"""trainer.tiny_model (the CPU init job's output) and trainer.baseline (random vs scripted policy)."""

from __future__ import annotations

import json

from trainer import baseline, tiny_model


def test_tiny_model_is_complete_and_trl_ready(tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        qwen3_chat_template,
    )

    assert tiny_model.is_complete(tiny_model_dir)
    meta = json.loads((tiny_model_dir / tiny_model.MARKER).read_text())
    assert meta["sample_check"]["tool_calls"] > 0  # the warm-start taught the call format
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == ("qwen3", 128, 2, 4, 2, 32, True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.chat_template == qwen3_chat_template  # the copy TRL recognizes
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    add_response_schema(tok)  # raises "Unrecognized chat template" otherwise
    # Qwen3's template is not prefix-preserving, so GRPO renders with TRL's training template:
    # the warm-start used exactly that one.
    assert not is_chat_template_prefix_preserving(tok) and get_training_chat_template(tok) is not None


def test_tiny_model_is_idempotent(tiny_model_dir, capsys):
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny_model.main(["--out", str(tiny_model_dir)]) == 0
    assert "already complete; nothing to do" in capsys.readouterr().out
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_warm_on_picks_the_built_in_envs_to_warm_start_on(tmp_path, capsys):
    """--warm-on catch: the demos are catch's (built-ins otherwise share echo's, and the model never calls another env's
    tools); a name that is not a built-in env stops with one line naming the valid ones, before any work."""
    import pytest

    assert list(tiny_model.builtin_specs("catch")) == ["catch"]
    assert tiny_model.tools_fingerprint(tiny_model.builtin_specs("catch")) != tiny_model.BUILTIN_FINGERPRINT
    with pytest.raises(SystemExit) as exited:
        tiny_model.main(["--out", str(tmp_path / "m"), "--warm-on", "chess"])
    assert exited.value.code == 2 and not (tmp_path / "m").exists()
    assert "error: Unknown environment 'chess'; valid choices: catch, echo, wordle." in capsys.readouterr().err


def test_baseline_random_vs_scripted(echo_server, capsys):
    import os

    os.environ["ENV_URLS"] = f"echo={echo_server.url}"
    try:
        assert baseline.main(["--episodes", "12"]) == 0
    finally:
        del os.environ["ENV_URLS"]
    out = capsys.readouterr().out
    assert "[baseline] echo          random: 12 episodes, mean reward" in out
    assert "[baseline] echo scripted expert: 12 episodes, mean reward 1.000" in out
    assert "echo: room to learn: random" in out


def test_baseline_env_down(capsys, monkeypatch):
    monkeypatch.setenv("ENV_URLS", "echo=http://127.0.0.1:9")
    assert baseline.main(["--episodes", "1"]) == 1
    assert "[baseline] echo: cannot play" in capsys.readouterr().err
