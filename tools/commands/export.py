"""Write a run's checkpoint as a standalone model folder in exports/<run>/, optionally pushed to the Hub: `export [--run R] [--checkpoint N] [--push org/name]` (trainer.export)."""

from __future__ import annotations

import os

from tools import stack
from tools.prepare import prepare


def run(rest: list[str]) -> int:
    compose_vars, _ = prepare()
    # made here, as this user: Docker would create a missing bind-mount source owned by root
    (stack.ROOT / "exports").mkdir(exist_ok=True)
    stack.compose(compose_vars, "--progress", "quiet", "build", "trainer-cpu-image", extra_profiles=("build",))
    # as the host user, like `make report`: the folder is theirs; the compose service adds the volume and the secret
    return stack.compose(compose_vars, "run", "--rm", "--no-deps", "--user", f"{os.getuid()}:{os.getgid()}", "export", *rest)
