"""Catch on open-spiel 2.0.2, upstream OpenEnv openspiel_env's wire schema."""

# This folder's declaration as a built-in env (the keys: envs/echo/__init__.py, envs/registry.py).
ENV = {
    "upstream_env_name": "openspiel_env",
    "tool_class": "tool:CatchTool",
    "task": "task",
    "server_parts": "server:server_parts",
    "episode_budget_tokens": 768,
}
