"""A run's checkpoint as a model folder in exports/<run>/: `export [--run R] [--checkpoint N|best] [--push org/name]`."""

from __future__ import annotations

import os

from tools import settings
from tools.images import TRAINER_CPU_BUILD
from tools.prepare import prepare


def run(rest: list[str]) -> int:
    prepared = prepare()
    # made here, as this user: Docker would create a missing bind-mount source owned by root
    (settings.ROOT / "exports").mkdir(exist_ok=True)
    prepared.build(TRAINER_CPU_BUILD, extra_profiles=("build",), quiet=True)
    # as the host user, like `make report`: the folder is theirs; the compose service adds the volume and the secret
    user = f"{os.getuid()}:{os.getgid()}"
    return prepared.compose("run", "--rm", "--no-deps", "--user", user, "export", *rest)
