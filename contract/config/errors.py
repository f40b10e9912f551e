"""A bad setting, said in one line per problem, naming the variable and the fix."""

from __future__ import annotations

from pydantic import ValidationError

# Messages that already name their variables (cross-field rules): shown without a `VAR: ` prefix.
SELF_NAMED = ("PER_DEVICE", "ENV_URLS names", "LORA_", "QLORA")


class ConfigError(ValueError):
    """A bad setting; the message names the variable and the fix, one line per problem."""


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        var = str(err["loc"][0]).upper() if err.get("loc") else "CONFIG"
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if err["type"] != "value_error":  # pydantic's own type/range messages: add the value and the fix
            got = err.get("input")
            msg = f"{msg} (got {got!r}; edit .env or the --{var.lower().replace('_', '-')} flag)"
        if var == "CONFIG" or var.startswith("_") or msg.startswith(SELF_NAMED):
            lines.append(msg)
        else:
            lines.append(f"{var}: {msg}")
    return "\n".join(lines)
