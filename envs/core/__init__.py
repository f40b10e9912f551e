"""The core every env shares: `server` (our OpenEnv HTTP/WebSocket server), `client` (the session
client the tool classes use), `tool` (the tool-instance contract), `settings` (the server's typed settings)."""

from pathlib import Path

# Where the env-server image puts each env's build-time data: envs/<name>/build_data.py wrote DATA_ROOT/<name>
# (services/env-server/Dockerfile; tests/envs/test_env_folders.py checks both say the same).
DATA_ROOT = Path("/opt/env-data")
