"""VLLM_EXTRA_ARGS: extra `vllm serve` flags from .env, for the vllm service, its CPU twin and (mapped to engine
arguments) the engine TRL colocates in the trainer. Standard library only (the host validates .env with it).

The stack relies on some flags: compose.yaml's `x-vllm-serve-flags` (model, host/port, the NCCL weight transfer, the
log-prob mode TRL's importance sampling reads, the length and memory limits and the parallel sizes `make` derives from
.env), the LoRA serving flags contract.lora_rules adds, and a few that would move the API or the weight-sync world out
from under TRL's client. An extra flag that names one of them is refused (one line naming it): set the .env variable
that owns it instead. Anything else goes through as written, e.g. `VLLM_EXTRA_ARGS=--no-async-scheduling`.
"""

from __future__ import annotations

import json
import shlex

# flag (as vLLM spells it, no dashes) -> the .env variable (or reason) that owns it
RESERVED = {
    "model": "MODEL_NAME", "host": "the stack (0.0.0.0 on the private network)", "port": "the stack (8000)",
    "weight-transfer-config": "the stack (TRL's NCCL weight sync)",
    "logprobs-mode": "the stack (TRL's importance sampling reads processed log-probs)",
    "max-logprobs": "the stack (TRL asks for any number of log-probs)",
    "max-model-len": "VLLM_MAX_MODEL_LEN", "gpu-memory-utilization": "VLLM_GPU_MEMORY_UTILIZATION",
    "revision": "MODEL_REVISION", "tokenizer-revision": "MODEL_REVISION", "tokenizer": "MODEL_NAME",
    "tensor-parallel-size": "VLLM_GPU and VLLM_PARALLEL", "data-parallel-size": "VLLM_GPU and VLLM_PARALLEL",
    "pipeline-parallel-size": "VLLM_GPU and VLLM_PARALLEL (the weight sync's world size is checked against them)",
    "enable-lora": "LORA_R with ROLLOUTS=async", "max-lora-rank": "LORA_R", "max-loras": "LORA_R",
    "api-key": "the stack (TRL's client sends no key)", "served-model-name": "MODEL_NAME",
    "config": "the stack (a config file could set any of these flags)", "headless": "the stack",
    "root-path": "the stack (TRL's client calls the routes at /)",
}
SHORT = {"tp": "tensor-parallel-size", "dp": "data-parallel-size", "pp": "pipeline-parallel-size"}
# colocate: `vllm serve` flags that only the HTTP server has (TRL builds `vllm.LLM`, an engine with no server)
SERVER_ONLY_PREFIXES = ("uvicorn", "ssl", "allowed-", "allow-credentials", "disable-log-requests", "enable-log-requests",
                        "chat-template", "response-role", "tool-", "enable-auto-tool-choice", "middleware",
                        "return-tokens-as-token-ids", "disable-fastapi-docs", "enable-prompt-tokens-details",
                        "enable-server-load-tracking", "enable-force-include-usage", "api-server-count", "lora-modules",
                        "disable-frontend-multiprocessing", "max-log-len", "log-config-file")
# colocate: flags TRL 1.16 passes to `LLM(...)` itself (vllm_generation.VLLMGeneration._init_vllm), or maps from
# GRPOConfig fields the trainer sets
TRL_SETS = ("max-num-seqs", "max-num-batched-tokens", "distributed-executor-backend", "seed", "quantization",
            "trust-remote-code")
TRL_FIELDS = {"model-impl": "vllm_model_impl", "enable-sleep-mode": "vllm_enable_sleep_mode"}


def flag_name(token: str) -> str | None:
    """`--max_model_len=5` -> `max-model-len`, `-tp` -> `tensor-parallel-size`; None for a value (no dash)."""
    if not token.startswith("-") or token in ("-", "--") or _is_number(token):
        return None
    name = token.lstrip("-").split("=", 1)[0].replace("_", "-").lower()
    return SHORT.get(name, name)


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def parse(text: str | None) -> list[str]:
    """The flags of VLLM_EXTRA_ARGS as `vllm serve` arguments (shell words; quotes group). ValueError, one line, for a
    flag the stack relies on, or text that does not split."""
    try:
        words = shlex.split(text or "")
    except ValueError as exc:
        raise ValueError(f"does not split into shell words ({exc}); quote values that hold "
                         "spaces, e.g. --override-generation-config '{\"temperature\": 1.0}' (edit .env)") from None
    if words and flag_name(words[0]) is None:
        raise ValueError(f"must start with a flag (`--...`), not {words[0]!r} (the model is "
                         "MODEL_NAME; edit .env)")
    for word in words:
        name = flag_name(word)
        base = name[3:] if name and name.startswith("no-") and name[3:] in RESERVED else name
        if base in RESERVED:
            raise ValueError(f"{word.split('=', 1)[0]} is set by {RESERVED[base]}; drop it from "
                             "VLLM_EXTRA_ARGS (edit .env)")
    return words


def checked(text: str) -> str:
    """RunConfig's validator: VLLM_EXTRA_ARGS as written, once `parse` accepts it."""
    parse(text)
    return text


def _value(text: str):
    """An engine argument from its command-line text: JSON (numbers, true/false, objects) where it parses."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def engine_kwargs(words: list[str]) -> tuple[dict, dict]:
    """VLLM_EXTRA_ARGS (parsed) for colocate: (engine kwargs for `vllm.LLM`, GRPOConfig kwargs). `--x-y v` -> x_y=v,
    `--flag` -> flag=True, `--no-flag` -> flag=False. ValueError, one line, for a flag that cannot be mapped: one only
    the HTTP server has, or one TRL already passes."""
    engine: dict = {}
    grpo: dict = {}
    i = 0
    while i < len(words):
        word = words[i]
        name = flag_name(word)
        if "=" in word:
            raw = word.split("=", 1)[1]
        elif i + 1 < len(words) and flag_name(words[i + 1]) is None:
            raw, i = words[i + 1], i + 1
        else:
            raw = None
        i += 1
        if name.startswith(SERVER_ONLY_PREFIXES):
            raise ValueError(f"--{name} (VLLM_EXTRA_ARGS) is a flag of vLLM's HTTP server; TRAIN_MODE=colocate runs "
                             "vLLM's engine inside the trainer with no server: drop it (edit .env)")
        if name in TRL_SETS:
            raise ValueError(f"--{name} (VLLM_EXTRA_ARGS) is set by TRL's colocated engine itself (trl "
                             "VLLMGeneration); it cannot be passed there: drop it (edit .env)")
        negated = raw is None and name.startswith("no-")
        key = name[3:] if negated else name
        value = (not negated) if raw is None else _value(raw)
        if key in TRL_FIELDS:
            grpo[TRL_FIELDS[key]] = value
        else:
            engine[key.replace("-", "_")] = value
    return engine, grpo


def scheduler_detail(state: bool | None, source: str, words: list[str]) -> str:
    """The line `make gpu-smoke` prints: which scheduler vLLM ran (`state` as `source` reported it), else the flag
    state it was started with."""
    asked = async_scheduling(words)
    flags = ("--no-async-scheduling" if asked is False else "--async-scheduling" if asked else
             "no scheduling flag (vLLM's default: async on a GPU, off on its CPU platform)")
    if state is None:
        return f"not reported ({source}); started with {flags}"
    return (f"{'async' if state else 'sync (not async)'} scheduling, from {source}; started with {flags}"
            + ("" if not state else "; if async weight pushes misbehave, try VLLM_EXTRA_ARGS=--no-async-scheduling"))


def async_scheduling(words: list[str]) -> bool | None:
    """The scheduler these flags ask for: False for --no-async-scheduling, True for --async-scheduling, None for
    vLLM's default (async on a GPU, off on its CPU platform)."""
    state = None
    for word in words:
        name = flag_name(word)
        if name == "async-scheduling":
            state = word.split("=", 1)[1].lower() not in ("false", "0") if "=" in word else True
        elif name == "no-async-scheduling":
            state = False
    return state
