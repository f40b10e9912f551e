"""Wordle on textarena 0.7.4, upstream OpenEnv textarena_env's wire schema."""

# This folder's declaration as a built-in env (the keys: envs/echo/__init__.py, envs/registry.py).
ENV = {
    "upstream_env_name": "textarena_env",
    "tool_class": "tool:WordleTool",
    "task": "task",
    "server_parts": "server:server_parts",
    "episode_budget_tokens": 1024,
}
