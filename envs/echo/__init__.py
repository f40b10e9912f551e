"""Echo: upstream OpenEnv echo_env's wire schema (MCP tools over CallToolAction), a tiny task."""

# What makes this folder a built-in env, named by the folder: envs/registry.py reads ENV from this text, without
# importing it (so a literal dict only); nothing else lists the env.
ENV = {
    "upstream_env_name": "echo_env",        # the env_name upstream's app passes to create_app (its wire schema)
    "tool_class": "tool:EchoTool",          # the TRL environment_factory class: this folder's module:class
    "task": "task",                         # make_dataset, demo_calls, baseline_action
    "server_parts": "server:server_parts",  # -> (factory, Action, Observation, State) for create_app
    "episode_budget_tokens": 96,            # rough completion tokens one episode needs (preflight warns below)
}
