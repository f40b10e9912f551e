"""The core every env shares: `server` (our OpenEnv HTTP/WebSocket server), `client` (the session
client the tool classes use), `tool` (the tool-instance contract), `settings` (the server's typed settings)."""
