"""What a process needs to call the judge (JudgeSetup): built once from the run's settings, pickled into ROLLOUTS=async's
spawned rollout worker with the reward function (so plain data: no client, no lock, no file handle)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from contract.config import RunConfig
from contract.config.judge import API_KEY_SECRET


@dataclass(frozen=True)
class JudgeSetup:
    base_url: str  # .../v1
    method: str  # rubric | ranking | reward_model
    score: str  # choice | probabilities
    template: str  # the rubric's text ('' for reward_model)
    judged_envs: frozenset[str]  # envs whose episodes are judged (ENV_<NAME>_JUDGE)
    concurrency: int
    timeout_s: float
    down_after_s: float
    max_tokens: int
    cache_size: int
    num_generations: int
    model: str | None = None  # the id the endpoint serves (/v1/models); None: asked on first use
    api_key_file: str = API_KEY_SECRET  # read when it exists; never logged

    def with_model(self, model: str | None) -> "JudgeSetup":
        return replace(self, model=model) if model else self

    @property
    def root_url(self) -> str:
        """The server's root (vLLM's pooling routes /classify, /tokenize sit beside /v1, not under it)."""
        return self.base_url[: -len("/v1")] if self.base_url.rstrip("/").endswith("/v1") else self.base_url

    def judges(self, env: str | None) -> bool:
        return env is None or env in self.judged_envs

    def describe(self, judge_weight: float, env_weight: float) -> str:
        """One line for the trainer's log (the URL without credentials)."""
        from envs.core.untrusted import strip_credentials

        how = {"rubric": self.score, "ranking": "relative, one call a group", "reward_model": "a classifier"}
        return (f"judge: {self.method} ({how[self.method]}) at {strip_credentials(self.base_url)}, weight "
                f"{judge_weight:g} beside the env's {env_weight:g}; judged envs: "
                f"{', '.join(sorted(self.judged_envs)) or 'none'}")


def rubric_path(name: str) -> Path:
    """JUDGE_RUBRIC as a file: as given (relative to the working directory), else under /prompts, where the trainer
    containers mount the checkout's prompts/ read-only (compose.yaml)."""
    path = Path(name)
    if path.exists() or path.is_absolute():
        return path
    parts = path.parts[1:] if path.parts and path.parts[0] == "prompts" else path.parts
    mounted = Path("/prompts", *parts)
    return mounted if mounted.exists() else path


def from_config(cfg: RunConfig, model: str | None = None) -> JudgeSetup | None:
    """The run's judge, or None when none is on. Reads the rubric file (a missing one is preflight's line)."""
    if not cfg.judge_on:
        return None
    template = ""
    if cfg.judge_method != "reward_model":
        path = rubric_path(cfg.judge_rubric)
        template = path.read_text() if path.is_file() else ""
    return JudgeSetup(
        base_url=str(cfg.judge_base_url).rstrip("/"), method=cfg.judge_method, score=cfg.judge_score,
        template=template, judged_envs=frozenset(n for n in cfg.env_names if cfg.judged(n)),
        concurrency=cfg.judge_concurrency, timeout_s=cfg.judge_timeout_s, down_after_s=cfg.judge_down_after_s,
        max_tokens=cfg.judge_max_tokens, cache_size=cfg.judge_cache_size, num_generations=cfg.num_generations,
        model=model)
