"""`.env` keys no setting reads (a misspelled `LEARNIG_RATE=0.1` would silently leave the default): each named in one
line with the closest known name. A warning, not a failure: users keep their own variables in `.env` too.

Known: the fields of the three typed settings classes (the host's StackEnv, the trainer's RunConfig, the env servers'
ServerSettings), every variable compose.yaml interpolates, every key `.env.example` names (set or commented out), and
the documented patterns below.
"""

from __future__ import annotations

import difflib
import functools
import re

from tools.settings import ENV_EXAMPLE, ROOT, StackEnv

# Read by someone legitimately though no settings class names them: ENV_<NAME>_* (an env's image, replicas, user,
# read by the generated compose file), secrets and ports, the trackers' and NCCL's own variables, Compose's and Docker's.
READ_BY_PATTERN = re.compile(r"ENV_[A-Z0-9]+_[A-Z0-9_]+|HF_[A-Z0-9_]+|[A-Z0-9_]+_PORT|WANDB_[A-Z0-9_]+|"
                             r"MLFLOW_[A-Z0-9_]+|NCCL_[A-Z0-9_]+|COMPOSE_[A-Z0-9_]+|DOCKER_[A-Z0-9_]+|STACK_[A-Z0-9_]+")


@functools.lru_cache(maxsize=1)
def known_keys() -> frozenset[str]:
    from envs.core.settings import ServerSettings
    from contract.config import RunConfig

    fields = {*StackEnv.model_fields, *(f.upper() for f in RunConfig.model_fields),
              *(f.upper() for f in ServerSettings.model_fields)}
    fields.discard("values")
    compose = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", (ROOT / "compose.yaml").read_text()))
    example = set(re.findall(r"^#?\s*([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), flags=re.M))
    return frozenset(fields | compose | example)


def unread_keys(values: dict[str, str]) -> list[str]:
    """One line per key of `values` that no setting reads, with the closest known name when one is close."""
    known = known_keys()
    lines = []
    for key in values:
        if key in known or READ_BY_PATTERN.fullmatch(key):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"did you mean {close[0]}?" if close else "no setting has a similar name"
        lines.append(f"{key} in .env: no setting reads it ({hint}); a variable of your own can stay")
    return lines
