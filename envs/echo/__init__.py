"""Echo: upstream OpenEnv echo_env's wire schema (MCP tools over CallToolAction), a tiny task."""
