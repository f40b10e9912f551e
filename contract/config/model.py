"""The model a run trains and how: MODEL_NAME at MODEL_REVISION, and `cfg.lora` (LoraSettings, QLoRA inside it; None
when LORA_R=0, full fine-tuning). The model's default depends on where it trains (cfg.placement)."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from contract import defaults
from contract.lora_rules import parse_target_modules

CPU_DEFAULT_MODEL = "/models/tiny-qwen3"
GPU_DEFAULT_MODEL = defaults.GPU_MODEL


def is_hub_id(name: str) -> bool:
    return not name.startswith(("/", ".")) and name.count("/") == 1


@functools.lru_cache(maxsize=None)
def local_snapshot(repo_id: str, revision: str) -> str | None:
    """The cached snapshot folder of repo_id at revision (a commit needs no refs/), or None when not cached."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not downloaded (yet): loaders go by name and revision
        return None


class LoraSettings(BaseModel):
    """Adapters on a frozen base (LORA_R > 0), as the trainer (trainer/modeling/lora.py) builds them."""

    model_config = ConfigDict(frozen=True)
    r: int
    alpha: float  # LORA_ALPHA, else 2 x r
    dropout: float
    target_modules: tuple[str, ...]  # LORA_TARGET_MODULES as checked at load: ("all-linear",) or layer names
    qlora: bool  # the base in 4-bit NF4

    @property
    def method(self) -> str:
        """lora or qlora: the word the log and the model card use."""
        return "qlora" if self.qlora else "lora"

    def description(self) -> str:
        base = "4-bit NF4 base (QLoRA)" if self.qlora else "frozen base"
        return (f"LoRA r={self.r}, alpha={self.alpha:g}, dropout={self.dropout:g}, "
                f"target modules {','.join(self.target_modules)}, on a {base}")


class ModelSettings(BaseModel):
    """MODEL_NAME, its revision and chat template switch, and the LoRA / QLoRA settings."""

    model_name: str | None = Field(
        None, description=f"Model for the GPU modes (hub id or local path); the CPU profile always trains its tiny "
        f"local model. Empty: `{CPU_DEFAULT_MODEL}` on CPU, `{GPU_DEFAULT_MODEL}` on GPU."
    )
    model_revision: str | None = Field(
        None, description="Hub revision (a commit) of MODEL_NAME: downloaded, checked (chat template) and loaded by "
        "vLLM and the trainer. Pin the one you tested; TRL recognises a chat template by exact match. Empty: main."
    )
    enable_thinking: bool = Field(
        False, description="Let the model think in `<think>` before it answers. Off by default for tool agents: a "
        "small model can spend MAX_COMPLETION_LENGTH thinking before its first tool call. Passed to TRL as "
        "chat_template_kwargs (the prompts it generates from and trains on)."
    )
    lora_r: int = Field(
        0, ge=0, description="LoRA rank: 0 trains every weight (full fine-tuning); N trains rank-N adapters on a frozen "
        "base (trainer/modeling/lora.py). vLLM serves ranks up to 512 (its --max-lora-rank choices)."
    )
    lora_alpha: float | None = Field(
        None, gt=0, description="LoRA scaling numerator (the update is alpha/r x B·A). Empty: 2 x LORA_R."
    )
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input while training. 0 by default: dropout makes the "
        "policy that scores its own samples differ from the one that generated them."
    )
    lora_target_modules: str = Field(
        "all-linear", description="Layers that get adapters: `all-linear` (every linear layer of the decoder: "
        "attention q/k/v/o and MLP gate/up/down; not the embeddings or the head) or a comma list of layer names "
        "(e.g. `q_proj,v_proj`)."
    )
    qlora: bool = Field(
        False, description="LORA_R adapters on a 4-bit (NF4, bitsandbytes) base: about a quarter of the base's "
        "memory. GPU modes only (bitsandbytes' 4-bit kernels)."
    )

    @field_validator("lora_target_modules")
    @classmethod
    def _check_lora_target_modules(cls, value: str) -> str:
        return ",".join(parse_target_modules(value))  # one form, which `lora` splits

    @property
    def lora(self) -> LoraSettings | None:
        """The adapters this run trains; None: full fine-tuning (LORA_R=0, as .env writes it)."""
        if not self.lora_r:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_r
        return LoraSettings(r=self.lora_r, alpha=alpha, dropout=self.lora_dropout,
                            target_modules=tuple(self.lora_target_modules.split(",")), qlora=self.qlora)

    @property
    def model_id(self) -> str:
        """MODEL_NAME, else the default of where it trains (the CPU profile's tiny local model, else the GPU one)."""
        if self.model_name:
            return self.model_name
        return CPU_DEFAULT_MODEL if self.placement.spec.makes_model_locally else GPU_DEFAULT_MODEL  # type: ignore[attr-defined]

    @property
    def model_path(self) -> str:
        """What every trainer-side load reads: a hub model pinned to MODEL_REVISION as its snapshot folder in the
        local cache, once model-download has put it there. A download at a commit writes no `refs/main`, so a load
        by name without a revision (TRL colocate's `LLM(model=model.name_or_path)`, trainer.sync_check) would
        look up `main` under HF_HUB_OFFLINE=1 and fail; a folder needs no lookup."""
        name = self.model_id
        if self.model_revision and is_hub_id(name):
            return local_snapshot(name, self.model_revision) or name
        return name

    @property
    def model_load_kwargs(self) -> dict[str, Any]:
        """from_pretrained kwargs for model_path: the pinned revision while it is still a hub id (not cached yet)."""
        return {"revision": self.model_revision} if self.model_revision and is_hub_id(self.model_path) else {}

    def chat_template_kwargs(self) -> dict[str, Any]:
        """What TRL passes to apply_chat_template for every prompt it generates from and trains on."""
        return {"enable_thinking": self.enable_thinking}

    def training_description(self) -> str:
        """One line for the log and the model card."""
        lora = self.lora
        return lora.description() if lora else "full fine-tuning (every weight trained)"
