"""The trainer's GPU memory for a model and layout (standard library only: the host's `make doctor` imports it too).

Per trainer GPU, for `method="full"` (every weight trained, fp32 master weights, bf16 autocast, AdamW):

    weights     4 B x params / shards         fp32 master weights
    gradients   4 B x params / shards         fp32, like the weights they belong to
    optimizer   8 B x params / shards         AdamW's two fp32 moments
    activations T x (2 B x hidden x layers    bf16 layer inputs kept by gradient checkpointing (TRL's default)
                     + 34 B x hidden)         one layer recomputed in backward (Korthikanti et al. 2022, 34·s·b·h,
                                              SDPA/flash attention: no s² term)
                + C x 4 B x vocab             fp32 logits of the scored (completion) tokens: an upper bound, TRL's
                                              fused_lm_head chunks them
                without checkpointing: T x 34 B x hidden x layers + C x 4 B x vocab
                T = PER_DEVICE_TRAIN_BATCH_SIZE x (prompt tokens + MAX_COMPLETION_LENGTH),
                C = PER_DEVICE_TRAIN_BATCH_SIZE x MAX_COMPLETION_LENGTH
    push        2 B x the largest tensor      its bf16 copy for the weight push (+4 B gathered whole under fsdp)
    overhead    1 GiB                         CUDA context, allocator slack

shards = trainer processes under TRAINER_SHARDING=fsdp (or zero3), else 1 (ddp: a full copy per GPU). Available: the
whole GPU with TRAIN_MODE=gpu (vLLM has its own), (1 - VLLM_GPU_MEMORY_UTILIZATION) of it when colocated.

`method` is where LoRA/QLoRA plug in: `BYTES_PER_PARAM` says what each method keeps per frozen and per trainable
parameter; only "full" exists for now.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

GIB = 1024 ** 3
OVERHEAD_BYTES = 1 * GIB
SHARDED = ("fsdp", "zero3")  # TRAINER_SHARDING values that split weights, gradients and optimizer over the GPUs
GRADIENT_CHECKPOINTING = True  # TRL's GRPOConfig default, which the project keeps (tests check it)
DEFAULT_PROMPT_TOKENS = 512  # the host's assumption; the trainer's preflight measures the longest prompt

# bytes per parameter: (weights, gradients, optimizer) for trainable parameters. A method that freezes the base
# (LoRA) would add its frozen bytes and a trainable share here.
BYTES_PER_PARAM: dict[str, tuple[int, int, int]] = {"full": (4, 4, 8)}


class ShapeError(ValueError):
    """A config.json this module cannot size; the message says which key is missing."""


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qk_norm: bool = False  # Qwen3: a head_dim RMSNorm on q and on k in every layer
    attention_bias: bool = False
    experts: int = 0  # mixture of experts: this many MLPs per layer (+ a router)
    expert_intermediate: int = 0

    @classmethod
    def from_config(cls, config: dict) -> "ModelShape":
        """From a transformers config.json (a multimodal one's `text_config`)."""
        cfg = config.get("text_config") or config
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            return cls(
                vocab=int(cfg["vocab_size"]), hidden=hidden, intermediate=int(cfg["intermediate_size"]),
                layers=int(cfg["num_hidden_layers"]), heads=heads,
                kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                tied=bool(config.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
                qk_norm=str(cfg.get("model_type", "")).startswith("qwen3"),
                attention_bias=bool(cfg.get("attention_bias", False)),
                experts=experts, expert_intermediate=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShapeError(f"config.json lacks {exc} (or it is not a number): cannot estimate the trainer's "
                               "memory for this model") from None

    def params(self) -> int:
        """Parameter count: embeddings (+ an untied lm_head), attention, gated MLP (or experts), RMSNorms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        if self.attention_bias:
            attention += q + 2 * kv
        mlp = 3 * self.hidden * self.intermediate  # gate, up, down
        if self.experts:
            mlp = self.experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * (attention + mlp + norms) + self.hidden

    def largest_tensor(self) -> int:
        return max(self.vocab * self.hidden, self.hidden * max(self.intermediate, self.heads * self.head_dim))


@dataclass(frozen=True)
class Estimate:
    params: int
    shards: int
    tokens: int  # per micro-batch per GPU
    weights: int
    gradients: int
    optimizer: int
    activations: int
    push: int
    overhead: int
    gradient_checkpointing: bool
    method: str

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.push + self.overhead

    def breakdown(self) -> str:
        """One line: each part in GiB, and the total per trainer GPU."""
        sharded = f", sharded over {self.shards} GPUs" if self.shards > 1 else ""
        return (f"{self.params / 1e9:.2f}B params ({self.method}{sharded}): weights {gib(self.weights)} + gradients "
                f"{gib(self.gradients)} + AdamW {gib(self.optimizer)} + activations {gib(self.activations)} "
                f"({self.tokens} tokens/micro-batch, gradient checkpointing "
                f"{'on' if self.gradient_checkpointing else 'off'})"
                f" + push {gib(self.push)} + overhead {gib(self.overhead)} = {gib(self.total)} per trainer GPU")


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def estimate(shape: ModelShape, *, processes: int = 1, sharding: str = "ddp", batch: int = 8,
             prompt_tokens: int = DEFAULT_PROMPT_TOKENS, completion_tokens: int = 256,
             gradient_checkpointing: bool = GRADIENT_CHECKPOINTING, method: str = "full") -> Estimate:
    """Bytes per trainer GPU (the formula is the module's docstring)."""
    if method not in BYTES_PER_PARAM:
        raise ShapeError(f"training method {method!r} has no memory model (known: {', '.join(BYTES_PER_PARAM)})")
    w, g, o = BYTES_PER_PARAM[method]
    params = shape.params()
    shards = max(processes, 1) if sharding in SHARDED else 1
    tokens = batch * (prompt_tokens + completion_tokens)
    per_token = (2 * shape.hidden * shape.layers + 34 * shape.hidden if gradient_checkpointing
                 else 34 * shape.hidden * shape.layers)
    logits = batch * completion_tokens * 4 * shape.vocab
    push = shape.largest_tensor() * (2 + (4 if shards > 1 else 0))
    return Estimate(params=params, shards=shards, tokens=tokens, weights=math.ceil(w * params / shards),
                    gradients=math.ceil(g * params / shards), optimizer=math.ceil(o * params / shards),
                    activations=tokens * per_token + logits, push=push, overhead=OVERHEAD_BYTES,
                    gradient_checkpointing=gradient_checkpointing, method=method)


def available(total_bytes: int, colocate: bool, vllm_share: float) -> int:
    """What the trainer may use of one GPU: all of it, or what colocated vLLM leaves."""
    return int(total_bytes * (1 - vllm_share)) if colocate else int(total_bytes)


def verdict(est: Estimate, gpu_bytes: int, *, colocate: bool = False, vllm_share: float = 0.0) -> str | None:
    """None when the estimate fits; else one line: the numbers and what to change."""
    room = available(gpu_bytes, colocate, vllm_share)
    if est.total <= room:
        return None
    where = (f"{gib(room)} left of {gib(gpu_bytes)} after colocated vLLM's VLLM_GPU_MEMORY_UTILIZATION={vllm_share}"
             if colocate else f"{gib(gpu_bytes)}")
    fixes = []
    states = est.weights + est.gradients + est.optimizer
    rest = est.activations + est.overhead + (est.push if est.shards > 1 else 3 * est.push)  # fsdp gathers in fp32
    if colocate and vllm_share > 0:
        fixes.append("lower VLLM_GPU_MEMORY_UTILIZATION or give vLLM its own GPU (TRAIN_MODE=gpu)")
    if not colocate and rest < room:  # the model states can be sharded down to what is left (colocate: one GPU)
        need = math.ceil(states * est.shards / (room - rest))
        if need > est.shards:
            fixes.append(f"{need} trainer GPUs with TRAINER_SHARDING=fsdp (TRAINER_GPU)")
    if est.activations > room / 4:
        fixes.append("shorter lengths (MAX_COMPLETION_LENGTH) or a smaller PER_DEVICE_TRAIN_BATCH_SIZE "
                     "(with more GRADIENT_ACCUMULATION_STEPS)")
    fixes.append("a smaller model (MODEL_NAME)")
    return (f"the trainer needs ~{gib(est.total)} per GPU but has {where}: use "
            + ", or ".join(fixes) + " (edit .env)")


def check(config: dict, gpu_bytes: int, *, mode: str, processes: int, sharding: str, batch: int, prompt_tokens: int,
          completion_tokens: int, vllm_share: float, method: str = "full") -> tuple[Estimate, str | None]:
    """The estimate for a run's settings and its verdict on one trainer GPU of `gpu_bytes` (None: it fits)."""
    est = estimate(ModelShape.from_config(config), processes=processes, sharding=sharding, batch=batch,
                   prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, method=method)
    colocate = mode == "colocate"
    return est, verdict(est, gpu_bytes, colocate=colocate, vllm_share=vllm_share if colocate else 0.0)


def read_config(folder: str | Path) -> dict | None:
    """config.json of a model folder, or None when it is not there (not downloaded yet)."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
