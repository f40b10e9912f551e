"""Defaults the host (tools/) and the trainer share, written once (standard library only). compose.yaml's
`${VAR:-default}` fallbacks repeat them for a bare `docker compose` without .env; tests/tools/test_config_in_sync.py
checks that they agree. The env servers' session cap is theirs: envs.core.settings.DEFAULT_MAX_CONCURRENT_ENVS."""

GPU_MODEL = "Qwen/Qwen3-0.6B"
VLLM_IMAGE = "vllm/vllm-openai:v0.31.0"  # trl's vllm extra pins vllm<=0.31.0: both sides of NCCL run this vLLM
# trainer.launch exits with this when the vllm service must restart before training (a weight push left unfinished,
# or no one-token answer: trainer.gpu.push_state); `make train` restarts it and trains again (tools/commands/train.py).
EXIT_VLLM_RESTART = 76
# the trainer exits with this when vLLM went away mid-run (died, stopped or restarted: the weights pushed to it went
# with it: trainer.gpu.server.went_away); `make train` restarts it and trains again resuming from the last checkpoint.
EXIT_VLLM_WENT_AWAY = 77
# the trainer exits with this when the judge failed every call for JUDGE_DOWN_AFTER_S (trainer.judge.costs.JudgeDown):
# no row was scored by it (each failure is left out of the loss); `make train` again resumes from the last checkpoint.
EXIT_JUDGE_DOWN = 78
