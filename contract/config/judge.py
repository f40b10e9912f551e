"""JUDGE_*: a judge or reward model whose score joins the env's reward (docs/judge.md). Pydantic and stdlib only.

A judge is on when JUDGE_MODEL (the stack serves it: the `judge` service, vLLM on JUDGE_GPU, the vLLM CPU twin on the CPU
profile and in `make rehearse`) or JUDGE_URL (any OpenAI-compatible endpoint elsewhere; then no judge container starts)
is set. Three ways to judge (JUDGE_METHOD):

    rubric        one call per episode: the rubric file's template sees the task, the transcript and the env's reward;
                  the score is a constrained reply (JUDGE_SCORE=choice) or the probabilities of the answer tokens
                  (JUDGE_SCORE=probabilities), mapped to [0, 1]
    ranking       one call per GRPO group (RULER-style): all NUM_GENERATIONS episodes, scored relative to each other
    reward_model  a sequence classifier (a reward model: one label) on vLLM's pooling runner (`/classify`): no rubric

Its reward function is `judge` (TRL logs `rewards/judge/mean`), weighed by JUDGE_WEIGHT beside the env's own reward
(ENV_REWARD_WEIGHT); ENV_<NAME>_JUDGE=0 leaves an env's episodes unjudged. A failed judge call (timeout, 5xx, refusal,
unparseable reply) is never a reward: that row is left out of the loss and its group's baseline (`judge/failures`).
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

JudgeMethod = Literal["rubric", "ranking", "reward_model"]
JudgeScore = Literal["choice", "probabilities"]
DEFAULT_RUBRIC = "prompts/judge/rubric.md"
# The CPU profile's tiny judge: JUDGE_MODEL naming it makes model-init build it (trainer.tiny_judge, docs/judge.md).
TINY_JUDGE = "/models/tiny-judge"
# ... and its tiny reward model (JUDGE_METHOD=reward_model): a sequence classifier on the tiny policy's trunk
# (trainer.tiny_reward_model), made by model-init after the policy when JUDGE_MODEL names it.
TINY_REWARD_MODEL = "/models/tiny-reward-model"
SERVED_URL = "http://judge:8000/v1"  # the stack's judge service (agentnet only): compose.yaml `judge`
# JUDGE_URL's key: the host's JUDGE_API_KEY_FILE, mounted as a Compose secret (never an env var, a log or a trace).
API_KEY_SECRET = "/run/secrets/judge_api_key"


def judge_var(env_name: str) -> str:
    """The per-env switch's variable: ENV_<NAME>_JUDGE (as ENV_<NAME>_PORT, envs.naming)."""
    return f"ENV_{env_name.upper().replace('-', '_')}_JUDGE"


class JudgeSettings(BaseModel):
    """RunConfig's JUDGE_* fields and ENV_REWARD_WEIGHT (a base of contract.config.RunConfig)."""

    judge_model: str | None = Field(
        None, description="A judge the stack serves (Hugging Face id, fetched by the same init job as MODEL_NAME): "
        "vLLM on JUDGE_GPU, the vLLM CPU twin on the CPU profile and in `make rehearse` (docs/judge.md). Empty, and "
        "JUDGE_URL empty: no judge, every reward is the env's.")
    judge_model_revision: str | None = Field(
        None, description="The judge model's pinned revision (a commit hash or tag); empty: main.")
    judge_url: str | None = Field(
        None, description="An OpenAI-compatible endpoint elsewhere (e.g. https://host/v1) instead of a served judge: "
        "no judge container starts. Its key comes from the secret file JUDGE_API_KEY_FILE, never from .env.")
    judge_method: JudgeMethod = Field(
        "rubric", description="How the judge scores: rubric (one call per episode, the rubric file's template), "
        "ranking (one call per GRPO group, episodes scored relative to each other), reward_model (a sequence "
        "classifier served by vLLM's pooling runner).")
    judge_rubric: str = Field(
        DEFAULT_RUBRIC, description="The rubric file (under prompts/, mounted read-only): a template seeing "
        "{task}, {transcript}, {env_reward} (rubric) or {task}, {episodes} (ranking); prompts/judge/README.md.")
    judge_score: JudgeScore = Field(
        "choice", description="rubric: the score from a constrained reply (choice: vLLM structured outputs, one of "
        "the rubric's allowed answers) or from the probabilities of its answer tokens (probabilities), mapped to "
        "[0, 1].")
    judge_weight: float = Field(1.0, ge=0, le=100, description="The judge's weight in the reward (TRL "
                                "reward_weights).")
    env_reward_weight: float = Field(1.0, ge=0, le=100, description="The env's own reward's weight beside the "
                                     "judge's (0: learn from the judge alone). Read only when a judge is on.")
    judge_concurrency: int = Field(8, ge=1, le=256, description="Judge calls in flight at once across the batch.")
    judge_timeout_s: float = Field(60.0, gt=0, le=3600, description="One judge call's bound; past it the row is a "
                                   "judge failure (left out of the loss), never a 0.")
    judge_down_after_s: float = Field(
        300.0, gt=0, le=86400, description="A judge failing every call for this long stops the run in one line; "
        "`make train` resumes once it is back.")
    judge_max_tokens: int = Field(256, ge=1, le=8192, description="rubric/ranking: the judge's reply budget "
                                  "(its rationale and verdict).")
    judge_cache_size: int = Field(4096, ge=0, le=1_000_000, description="Judge replies kept per trainer process for "
                                  "identical requests (the same episode text, method and rubric: answered once); 0: "
                                  "no cache.")

    @field_validator("judge_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"JUDGE_URL={value!r} is not an http(s) URL; set the endpoint's base, e.g. "
                             "https://host/v1 (edit .env)")
        return value

    @model_validator(mode="after")
    def _check_judge(self) -> "JudgeSettings":
        if self.judge_model and self.judge_url:
            raise ValueError("JUDGE_MODEL and JUDGE_URL are both set: JUDGE_MODEL is a judge the stack serves, "
                             "JUDGE_URL one elsewhere; keep one (edit .env)")
        return self

    @property
    def judge_on(self) -> bool:
        return bool(self.judge_model or self.judge_url)

    @property
    def judge_base_url(self) -> str | None:
        """Where the trainer calls the judge: JUDGE_URL, else the stack's judge service (None: no judge)."""
        return self.judge_url or (SERVED_URL if self.judge_model else None)

    def judged(self, env_name: str, environ: "os._Environ[str] | dict[str, str] | None" = None) -> bool:
        """Whether `env_name`'s episodes are judged: a judge is on and ENV_<NAME>_JUDGE is not 0/false/off."""
        value = (os.environ if environ is None else environ).get(judge_var(env_name), "").strip().lower()
        return self.judge_on and value not in ("0", "false", "off", "no")
