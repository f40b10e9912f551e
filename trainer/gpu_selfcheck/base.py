"""What every self-check shares: a check's result line, the model shapes, bf16 autocast as training runs it."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here downloads
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

GB = 1e9


class CheckTimeout(Exception):
    pass


@dataclass
class Result:
    name: str
    verdict: str  # PASS, FAIL, SKIP
    detail: str
    figures: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.verdict:<4} {self.name}: {self.detail}"


# ---------------------------------------------------------------------------- shapes
def qwen3_config(tiny: bool, vocab_size: int | None = None):
    """Qwen3-0.6B's shape (config.json of Qwen/Qwen3-0.6B), or trainer.tiny_model's tiny one."""
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(vocab_size=vocab_size or 1024, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                           tie_word_embeddings=True, bos_token_id=None)
    return Qwen3Config(vocab_size=vocab_size or 151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None)


def param_group(name: str) -> str:
    """Parameter groups of a Qwen3 decoder, by the name's last parts."""
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embed"
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attn"
    if any(k in name for k in ("gate_proj", "up_proj", "down_proj")):
        return "mlp"
    return "norm"  # input/post-attention layernorms, q_norm/k_norm, the final norm


def autocast(device):
    """What GRPOConfig(bf16=True) does on a GPU: bf16 autocast around fp32 (or bf16) weights."""
    import torch

    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()

