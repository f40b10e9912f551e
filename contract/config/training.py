"""What one optimizer step is made of (batch, lengths, rate, rewards) and how long the run trains."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

# The 0.5M-parameter tiny model: Adam moves every weight by about lr per step whatever its gradient, so 5e-4 was a
# random kick per step (and 2e-3 erased tool calling in one step); 2e-4 learns the echo task in ~20 steps, stably.
CPU_DEFAULT_LR = 2e-4
GPU_DEFAULT_LR = 1e-5
# LoRA (LORA_R > 0): an adapter's update B·A starts at zero and moves only through a rank-r bottleneck scaled by
# alpha/r, so the same lr moves the policy far less than full fine-tuning does: the usual LoRA rates are ~10x higher.
CPU_DEFAULT_LORA_LR = 2e-3
GPU_DEFAULT_LORA_LR = 1e-4


class TrainingSettings(BaseModel):
    """Steps, batch shape, lengths, sampling, rewards, seed and resume."""

    max_steps: int = Field(30, ge=1, description="Optimizer steps to train.")
    learning_rate: float | None = Field(
        None, gt=0, le=1, description="AdamW learning rate. Empty: 1e-5 on GPU, 2e-4 on CPU (the tiny model of the CPU "
        "profile and `make rehearse`); with LORA_R set "
        "1e-4 on GPU, 2e-3 on CPU (adapters need ~10x the full fine-tuning rate)."
    )
    num_generations: int = Field(4, ge=2, description="Completions per prompt (GRPO group size).")
    per_device_train_batch_size: int = Field(
        8, ge=1, description="Completions per device per micro-step (multiple of NUM_GENERATIONS with the below)."
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    steps_per_generation: int | None = Field(
        None, ge=1, description="Micro-steps served by one generation batch. Empty: GRADIENT_ACCUMULATION_STEPS."
    )
    max_completion_length: int = Field(
        256, ge=8, description="Token budget for a whole episode: all assistant turns plus tool results."
    )
    max_tool_calling_iterations: int | None = Field(
        4, ge=1, description="Tool calls allowed per episode (empty: unlimited)."
    )
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature for rollouts (vLLM refuses above 2).")
    unfinished_penalty: float = Field(
        1.0, ge=0, le=100, description="Reward taken from an episode a budget ended before the model ended it, in both "
        "modes: a turn cut at MAX_COMPLETION_LENGTH or the server's max_model_len, or a tool-calling turn whose round "
        "did not fit or came after MAX_TOOL_CALLING_ITERATIONS. Logged as rewards/unfinished/mean; 0 turns it off. "
        "Without it, turns after the env has decided the reward can ramble to the cap unpunished."
    )
    zero_std_groups: Literal["keep", "drop", "resample"] = Field(
        "keep", description="Groups whose completions all scored the same (advantage 0; their share is logged as "
        "frac_reward_zero_std). keep: TRL's behaviour, their tokens count in the loss's normaliser. drop: out of it "
        "(as episodes the env side ended), so they do not shrink the other tokens' weight; a larger step when many "
        "groups are flat. resample: DAPO's dynamic sampling, more groups generated until the step holds its number of "
        "informative ones, within ZERO_STD_RESAMPLE_MAX (trainer/rollouts/zero_variance.py)."
    )
    zero_std_resample_max: float = Field(
        1.0, gt=0, le=16, description="ZERO_STD_GROUPS=resample: the most extra generation to replace flat groups, as "
        "a share of the groups a step trains (1: up to as many again; sync generates whole extra batches, so it rounds "
        "up to one). Past it, flat groups are trained as with keep. The share spent is logged as "
        "zero_std/extra_generation.")
    seed: int = Field(42, ge=0, description="Random seed (dataset, sampling, init).")
    resume: Literal["auto", "fresh"] = Field(
        "auto", description="auto: continue from the run's last checkpoint; fresh: delete the run folder, start over."
    )

    @property
    def effective_steps_per_generation(self) -> int:
        # TRL: steps_per_generation defaults to gradient_accumulation_steps.
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation batch per process (TRL: per_device_train_batch_size x steps_per_generation)."""
        return self.per_device_train_batch_size * self.effective_steps_per_generation

    def batch_problem(self) -> str | None:
        """One line when a generation batch does not hold whole prompt groups."""
        gen_batch = self.generation_batch_size
        if gen_batch % self.num_generations:
            return (f"PER_DEVICE_TRAIN_BATCH_SIZE x STEPS_PER_GENERATION = {self.per_device_train_batch_size} x "
                    f"{self.effective_steps_per_generation} = {gen_batch} completions per generation batch, which is "
                    f"not a multiple of NUM_GENERATIONS={self.num_generations} (GRPO needs whole prompt groups); "
                    f"e.g. set PER_DEVICE_TRAIN_BATCH_SIZE="
                    f"{self.num_generations * max(1, gen_batch // self.num_generations)} (edit .env)")
        return None

    @property
    def effective_learning_rate(self) -> float:
        """LEARNING_RATE, else the default of what trains: the tiny model on a trainer on CPU (the CPU profile and
        `make rehearse`'s server mode) or a GPU model, with adapters (LoRA) or every weight."""
        if self.learning_rate is not None:
            return self.learning_rate
        cpu = self.placement.trainer_on_cpu  # type: ignore[attr-defined]
        if self.lora:  # type: ignore[attr-defined]
            return CPU_DEFAULT_LORA_LR if cpu else GPU_DEFAULT_LORA_LR
        return CPU_DEFAULT_LR if cpu else GPU_DEFAULT_LR

    def training_kwargs(self) -> dict[str, Any]:
        """This section's part of what GRPOConfig and AsyncGRPOConfig both take (RunConfig.shared_trainer_kwargs)."""
        return dict(
            max_steps=self.max_steps,
            learning_rate=self.effective_learning_rate,
            num_generations=self.num_generations,
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            max_completion_length=self.max_completion_length,
            max_tool_calling_iterations=self.max_tool_calling_iterations,
            temperature=self.temperature,
            seed=self.seed,
            data_seed=self.seed,
        )
