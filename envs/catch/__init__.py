"""Catch on open-spiel 2.0.2, upstream OpenEnv openspiel_env's wire schema."""

# What makes this folder a built-in env, named by the folder: envs/registry.py reads ENV from this text, without
# importing it (so a literal dict only); nothing else lists the env.
ENV = {
    "upstream_env_name": "openspiel_env",   # the env_name upstream's app passes to create_app (its wire schema)
    "tool_class": "tool:CatchTool",         # the TRL environment_factory class: this folder's module:class
    "task": "task",                         # make_dataset, demo_calls, baseline_action
    "server_parts": "server:server_parts",  # -> (factory, Action, Observation, State) for create_app
    "episode_budget_tokens": 768,           # rough completion tokens one episode needs (preflight warns below)
}
