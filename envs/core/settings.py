"""The env server's settings: one typed class, read once from the environment (pydantic-settings).

    ServerSettings.load()            # os.environ (what `python -m envs.serve` does)
    ServerSettings.load({...})       # a dict instead (tests)

A bad value stops the server with one line naming the variable and what it takes.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from envs import registry

# The trainer's default generation batch per replica is far below this; one place for the number.
DEFAULT_MAX_CONCURRENT_ENVS = 256


class ServerSettings(BaseSettings):
    """Field name upper-cased = environment variable."""

    model_config = SettingsConfigDict(case_sensitive=False, env_ignore_empty=True, extra="ignore", frozen=True)

    env_name: str = Field(description="the env this server plays: a built-in one (envs.registry)")
    max_concurrent_envs: int = Field(DEFAULT_MAX_CONCURRENT_ENVS, ge=1,
                                     description="sessions one server holds; the next /ws gets CAPACITY_REACHED")
    session_timeout_s: Optional[float] = Field(600.0, description="idle sessions are closed after this; 0 turns it off")
    host: str = Field("0.0.0.0", description="listen address")
    port: int = Field(8000, ge=1, le=65535, description="listen port")
    ws_ping_interval_s: float = Field(20.0, gt=0, description="server keepalive ping interval")
    ws_ping_timeout_s: float = Field(60.0, gt=0, description="a client silent this long loses its session")
    max_message_bytes: int = Field(1 << 20, ge=1, description="bigger frames get MESSAGE_TOO_LARGE, session kept")
    ws_hard_max_bytes: int = Field(16 << 20, ge=1, description="uvicorn closes the socket (1009) above this")
    # Off by default: env frames are a few hundred bytes on a private network, and deflating each one
    # cost ~15 % of a Catch step's server CPU (py-spy); a client that offers it just gets plain frames.
    ws_per_message_deflate: bool = Field(False, description="compress frames when the client offers it")
    log_level: str = Field("info", description="uvicorn/server log level")
    # A slow env on purpose (`make bench-async`: each tool call 250 ms), without blocking the other sessions.
    step_delay_s: float = Field(0.0, ge=0, le=600, description="every step (a tool call) is answered this many "
                                "seconds later; 0: at once")

    # Upstream's create_app reads these two (openenv http_server.py): production drops /reset, /step and /state
    # (the /ws and /mcp paths stay); the web interface adds a Gradio UI at /web that drives one shared env.
    openenv_mode: str = Field("simulation", description="simulation | production (no HTTP /reset, /step, /state)")
    enable_web_interface: bool = Field(False, description="upstream's Gradio UI at /web (true/1/yes)")

    @field_validator("openenv_mode")
    @classmethod
    def _mode(cls, value: str) -> str:
        from openenv.core.env_server.types import ServerMode

        mode = value.strip().lower()
        if mode not in {m.value for m in ServerMode}:
            raise ValueError(f"choose one of {', '.join(m.value for m in ServerMode)}")
        return mode

    @field_validator("env_name")
    @classmethod
    def _known(cls, value: str) -> str:
        name = value.strip().lower()
        if not registry.is_builtin(name):
            raise ValueError(f"unknown environment {value!r}; choose one of {', '.join(registry.names())}")
        return name

    @field_validator("session_timeout_s")
    @classmethod
    def _zero_is_off(cls, value: Optional[float]) -> Optional[float]:
        return None if value is not None and value <= 0 else value

    @classmethod
    def load(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> "ServerSettings":
        """From the process environment (or `environ`), then `overrides`; SystemExit with one line per
        bad variable."""
        try:
            if environ is None:
                return cls(**overrides)
            values = {k.lower(): v for k, v in environ.items() if k.lower() in cls.model_fields and v != ""}
            return cls(_env_prefix="__none__", **{**values, **overrides})  # `environ` only, not os.environ
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                var = str(err["loc"][0]).upper() if err.get("loc") else "SETTINGS"
                msg = err["msg"].removeprefix("Value error, ")
                got = f" (got {err['input']!r})" if err["type"] != "missing" and "input" in err else ""
                lines.append(f"{var}: {msg}{got}" + ("; set it (e.g. ENV_NAME=echo)" if err["type"] == "missing" else ""))
            raise SystemExit("env server settings: " + "; ".join(lines)) from None
