"""The trainer's GPU memory for a model and layout (standard library only: the host's `make doctor` imports it too).

Per trainer GPU, for `FULL` (every weight trained, fp32 master weights, bf16 autocast, AdamW):

    weights     4 B x params / shards         fp32 master weights
    gradients   4 B x params / shards         fp32, like the weights they belong to
    optimizer   8 B x params / shards         AdamW's two fp32 moments
    autocast    2 B x params / shards         bf16 autocast's cached copy of each fp32 trainable weight, held until
                                              the forward ends (beside the fp32 gradients of an earlier micro-batch)
    activations T x (2 B x hidden x layers    bf16 layer inputs kept by gradient checkpointing (TRL's default)
                     + 34 B x hidden)         one layer recomputed in backward (Korthikanti et al. 2022, 34·s·b·h,
                                              SDPA/flash attention: no s² term)
                + C x 4 B x vocab             fp32 logits of the scored (completion) tokens: an upper bound, TRL's
                                              fused_lm_head chunks them
                without checkpointing: T x 34 B x hidden x layers + C x 4 B x vocab
                T = PER_DEVICE_TRAIN_BATCH_SIZE x (prompt tokens + MAX_COMPLETION_LENGTH),
                C = PER_DEVICE_TRAIN_BATCH_SIZE x MAX_COMPLETION_LENGTH
    push        2 GiB + 2 B x largest tensor  server mode: vLLM's two 1 GiB packed broadcast buffers, and the bf16
                                              copy of the tensor being cast (+4 B gathered whole under fsdp);
                                              colocate (in-process load, no packed buffers): the copy alone.
                                              vLLM's GPU receives into two 1 GiB buffers too, outside its share
                                              (vllm_push_room)
    overhead    1 GiB                         CUDA context, allocator slack

shards = trainer processes under TRAINER_SHARDING=fsdp (or zero3), else 1 (ddp: a full copy per GPU). Available: the
whole GPU with TRAIN_MODE=gpu (vLLM has its own), (1 - VLLM_GPU_MEMORY_UTILIZATION) of it when colocated.

LoRA and QLoRA (`LORA` / `QLORA`, LORA_R = r) train adapters only: A = r x in and B = out x r on every
targeted linear layer (default all of the decoder's: L = r x (in + out) per layer), so gradients and AdamW shrink to
the adapters' share, while the frozen base stays:

    lora    weights 4 B x P + 4 B x L    the base in fp32: TRL merges the adapter into it for every weight push and
                                         unmerges after; a bf16 base would drift by a rounding at each push
            gradients 4 B x L, optimizer 8 B x L, autocast 2 B x L (the frozen base is not cached)
    qlora   weights 0.52 B x P_lin       the base's linear layers in NF4 (4 bits + double-quantized block scales)
                    + 2 B x (P - P_lin)  the rest (embeddings, norms) in bf16
                    + 4 B x L            fp32 adapters
            gradients 4 B x L, optimizer 8 B x L, autocast 2 B x L
    activations as for full (the backward still runs through every frozen layer); push as for full (the merged
    weight is streamed one tensor at a time).
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

DEFAULT_LORA_R = 16  # the host's table and `make doctor` when LORA_R is 0 (full) but a LoRA row is shown
NF4_BYTES = 0.52  # 4 bits + one fp8 scale per 64 weights + fp32 per 256 scales (double quantization): ~4.13 bits


@dataclass(frozen=True)
class Method:
    """How the weights are trained, as far as memory goes (the formulas of the module's docstring)."""

    name: str  # full, lora, qlora: the estimate's word
    label: str  # what a line or the table shows
    adapters: bool  # rank-r adapters on a frozen base (gradients and AdamW the adapters' only)
    quantized: bool  # the base's linear layers in NF4: it cannot be sharded (RunConfig.lora_problem)
    next_fix: str | None  # the cheaper method the verdict suggests

    def frozen_bytes(self, shape: "ModelShape") -> float:
        """The frozen base's bytes (none: every weight is trained, counted as trainable)."""
        if not self.adapters:
            return 0.0
        params = shape.params()
        if not self.quantized:
            return 4.0 * params  # fp32: TRL merges the adapter into it for every push
        linear = shape.linear_params()
        return NF4_BYTES * linear + 2.0 * (params - linear)


FULL = Method("full", "full", False, False, f"adapters instead of every weight (LORA_R={DEFAULT_LORA_R}, or QLORA=true "
              "with it)")
LORA = Method("lora", "LoRA", True, False, "a 4-bit base (QLORA=true)")
QLORA = Method("qlora", "QLoRA", True, True, None)
METHODS = (FULL, LORA, QLORA)


def method_of(lora) -> Method:
    """The method a run's `cfg.lora` (contract.config.LoraSettings, None: full fine-tuning) trains with."""
    return FULL if lora is None else QLORA if lora.qlora else LORA
# vLLM 0.31's packed NCCL producer (server mode's and async's weight push): two 1 GiB buffers, filled in turn
PACKED_PUSH_BYTES = 2 * GIB
# What vLLM's side of such a push allocates outside its VLLM_GPU_MEMORY_UTILIZATION share, after its KV cache filled the
# share: the consumer's two 1 GiB receive buffers, and NCCL's own device buffers for the group (estimated, a few
# hundred MiB; read from vLLM's packed_tensor and NCCL's defaults, not measured: no GPU here).
VLLM_PUSH_ROOM_BYTES = PACKED_PUSH_BYTES + GIB // 2


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

    def linear_params(self) -> int:
        """The decoder's linear layers (what `all-linear` adapts and QLoRA quantizes): attention and MLP projections."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = (self.experts * 3 * self.hidden * self.expert_intermediate if self.experts
               else 3 * self.hidden * self.intermediate)
        return self.layers * (2 * self.hidden * q + 2 * self.hidden * kv + mlp)

    def lora_params(self, r: int) -> int:
        """Adapter parameters of rank r on every linear layer of the decoder: r x (in + out) each."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.expert_intermediate if self.experts else self.intermediate
        attention = (h + q) + 2 * (h + kv) + (q + h)
        mlp = 3 * (h + i) * (self.experts or 1)
        return r * self.layers * (attention + mlp)

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
    method: Method
    trainable: int = 0  # parameters AdamW updates: all of them (full) or the adapters' (LoRA, QLoRA)
    lora_r: int = 0
    autocast: int = 0  # bf16 autocast's cache of the trainable weights
    gather: int = 0  # what sharding would add to the push: the largest tensor gathered whole in fp32

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer + self.autocast + self.activations + self.push
                + self.overhead)

    def breakdown(self) -> str:
        """One line: each part in GiB, and the total per trainer GPU."""
        sharded = f", sharded over {self.shards} GPUs" if self.shards > 1 else ""
        method = (f"{self.method.name} r={self.lora_r}, {self.trainable / 1e6:.1f}M trainable" if self.method.adapters
                  else self.method.name)
        return (f"{self.params / 1e9:.2f}B params ({method}{sharded}): weights {gib(self.weights)} + gradients "
                f"{gib(self.gradients)} + AdamW {gib(self.optimizer)} + autocast cache {gib(self.autocast)} + "
                f"activations {gib(self.activations)} "
                f"({self.tokens} tokens/micro-batch, gradient checkpointing "
                f"{'on' if self.gradient_checkpointing else 'off'})"
                f" + push {gib(self.push)} + overhead {gib(self.overhead)} = {gib(self.total)} per trainer GPU")


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def estimate(shape: ModelShape, *, processes: int = 1, sharding: str = "ddp", batch: int = 8,
             prompt_tokens: int = DEFAULT_PROMPT_TOKENS, completion_tokens: int = 256,
             gradient_checkpointing: bool = GRADIENT_CHECKPOINTING, method: Method = FULL,
             lora_r: int = DEFAULT_LORA_R, packed_push: bool = True) -> Estimate:
    """Bytes per trainer GPU (the formula is the module's docstring)."""
    if method not in METHODS:
        known = ", ".join(m.name for m in METHODS)
        raise ShapeError(f"training method {method!r} has no memory model (known: {known})")
    params = shape.params()
    trainable = shape.lora_params(lora_r) if method.adapters else params
    lora_r = lora_r if method.adapters else 0
    frozen_bytes = method.frozen_bytes(shape)
    w, g, o = frozen_bytes + 4 * trainable, 4 * trainable, 8 * trainable
    shards = max(processes, 1) if sharding in SHARDED else 1
    tokens = batch * (prompt_tokens + completion_tokens)
    per_token = (2 * shape.hidden * shape.layers + 34 * shape.hidden if gradient_checkpointing
                 else 34 * shape.hidden * shape.layers)
    logits = batch * completion_tokens * 4 * shape.vocab
    gather = 4 * shape.largest_tensor()
    push = (PACKED_PUSH_BYTES if packed_push else 0) + 2 * shape.largest_tensor() + (gather if shards > 1 else 0)
    return Estimate(params=params, shards=shards, tokens=tokens, weights=math.ceil(w / shards),
                    gradients=math.ceil(g / shards), optimizer=math.ceil(o / shards),
                    activations=tokens * per_token + logits, push=push, overhead=OVERHEAD_BYTES,
                    gradient_checkpointing=gradient_checkpointing, method=method, trainable=trainable,
                    lora_r=lora_r, autocast=math.ceil(2 * trainable / shards), gather=gather)


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
    states = est.weights + est.gradients + est.optimizer + est.autocast
    rest = est.activations + est.overhead + est.push + (0 if est.shards > 1 else est.gather)  # fsdp gathers in fp32
    if colocate and vllm_share > 0:
        fixes.append("lower VLLM_GPU_MEMORY_UTILIZATION or give vLLM its own GPU (TRAIN_MODE=gpu)")
    if not colocate and rest < room:  # the model states can be sharded down to what is left (colocate: one GPU)
        need = math.ceil(states * est.shards / (room - rest))
        if need > est.shards and not est.method.quantized:  # QLoRA cannot shard (RunConfig.lora_problem)
            fixes.append(f"{need} trainer GPUs with TRAINER_SHARDING=fsdp (TRAINER_GPU)")
    if est.activations > room / 4:
        fixes.append("shorter lengths (MAX_COMPLETION_LENGTH) or a smaller PER_DEVICE_TRAIN_BATCH_SIZE "
                     "(GRADIENT_ACCUMULATION_STEPS keeps the batch; the estimate already holds its gradients)")
    if est.method.next_fix:
        fixes.append(est.method.next_fix)
    fixes.append("a smaller model (MODEL_NAME)")
    return (f"the trainer needs ~{gib(est.total)} per GPU but has {where}: use "
            + ", or ".join(fixes) + " (edit .env)")


def vllm_push_room(gpu_bytes: int, share: float) -> str | None:
    """TRAIN_MODE=gpu: None when vLLM's GPU keeps room for a weight push's receive side outside vLLM's share; else one
    line with the share that leaves it (at the default 0.9: a 24 GB card keeps 2.4 GiB, short of ~2.5)."""
    outside = gpu_bytes * (1 - share)
    if outside >= VLLM_PUSH_ROOM_BYTES:
        return None
    fits = math.floor((1 - VLLM_PUSH_ROOM_BYTES / gpu_bytes) * 100) / 100
    fix = (f"set VLLM_GPU_MEMORY_UTILIZATION={fits:g} or lower (edit .env)" if fits >= 0.5 else
           "give vLLM a bigger GPU (VLLM_GPU)")
    return (f"vLLM keeps {gib(outside)} of its {gib(gpu_bytes)} GPU outside VLLM_GPU_MEMORY_UTILIZATION={share:g}, and "
            f"each weight push allocates ~{gib(VLLM_PUSH_ROOM_BYTES)} there (two 1 GiB NCCL receive buffers and NCCL's "
            f"own): the first push would run out of memory; {fix}")


def check(config: dict, gpu_bytes: int, *, mode, processes: int, sharding: str, batch: int, prompt_tokens: int,
          completion_tokens: int, vllm_share: float, method: Method = FULL,
          lora_r: int = DEFAULT_LORA_R) -> tuple[Estimate, str | None]:
    """The estimate for a run's settings and its verdict on one trainer GPU of `gpu_bytes` (None: it fits). `mode`:
    the resolved TRAIN_MODE's variant (contract.config.TrainModeVariant; only its `colocated` is read)."""
    colocate = mode.colocated
    est = estimate(ModelShape.from_config(config), processes=processes, sharding=sharding, batch=batch,
                   prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, method=method,
                   lora_r=lora_r or DEFAULT_LORA_R, packed_push=not colocate)
    return est, verdict(est, gpu_bytes, colocate=colocate, vllm_share=vllm_share if colocate else 0.0)


def read_config(folder: str | Path) -> dict | None:
    """config.json of a model folder, or None when it is not there (not downloaded yet)."""
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def compare(config: dict, gpu_bytes: int | None = None, *, lora_r: int = 0, **settings) -> str:
    """One line: the estimate per trainer GPU for full fine-tuning, LoRA and QLoRA at these settings (`check`'s
    keyword arguments but method), and which of them fit `gpu_bytes` when given."""
    parts = []
    for method in METHODS:
        est, problem = check(config, gpu_bytes or 1 << 62, method=method, lora_r=lora_r, **settings)
        label = f"{method.label} r={est.lora_r}" if method.adapters else method.label
        fits = "" if gpu_bytes is None else (" fits" if problem is None else " does not fit")
        parts.append(f"{label} {gib(est.total)}{fits}")
    return "; ".join(parts)


# docs/gpu-host.md's "What fits" table: Qwen3's published shapes (config.json of each hub model), one trainer GPU with vLLM on
# its own (TRAIN_MODE=gpu), the default lengths and batch, prompts of DEFAULT_PROMPT_TOKENS.
QWEN3 = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False),
    "Qwen3-14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      tie_word_embeddings=False),
}
CARDS_MIB = {"24 GB": 24564, "48 GB": 46068, "80 GB": 81559, "141 GB": 143771}  # what nvidia-smi reports


def qwen3_config(name: str) -> dict:
    return {"model_type": "qwen3", "vocab_size": 151936, "num_key_value_heads": 8, "head_dim": 128,
            "attention_bias": False, **QWEN3[name]}


def fits_table(batch: int = 8, completion_tokens: int = 256, lora_r: int = DEFAULT_LORA_R) -> str:
    """The Markdown table in docs/gpu-host.md "What fits": per model the GiB of each method, per card which methods fit."""
    head = ["model", "full / LoRA / QLoRA per GPU", *CARDS_MIB]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in QWEN3:
        shape = ModelShape.from_config(qwen3_config(name))
        ests = {m: estimate(shape, batch=batch, completion_tokens=completion_tokens, method=m, lora_r=lora_r)
                for m in METHODS}
        cells = [name, " / ".join(f"{e.total / GIB:.1f}" for e in ests.values()) + " GiB"]
        for mib in CARDS_MIB.values():
            fit = [m.label for m, e in ests.items()
                   if verdict(e, mib * 1024 ** 2) is None]
            cells.append(", ".join(fit) or "none (shard: TRAINER_SHARDING=fsdp)")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
