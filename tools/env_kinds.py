"""ENV_NAME's envs by where they are served (built in, an OpenEnv image, a server elsewhere): ENV_NAME, ENV_URLS and
each ENV_<NAME>_IMAGE parsed once, into EnvKinds, which every host module below the plan takes. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from envs import naming
from tools.errors import StackError

# What .env.example set ENV_<NAME>_IMAGE to for the built-in envs before STACK_NAME (an image every checkout shared):
# in a .env of then, it means ours, this stack's (tools/images.py).
SHARED_IMAGE_BEFORE = "grpo-stack/env-server:local"


@dataclass(frozen=True)
class EnvKinds:
    """ENV_NAME's envs by where they are served: ENV_NAME, ENV_URLS and each ENV_<NAME>_IMAGE parsed once."""

    names: tuple[str, ...]          # every env of the run, in ENV_NAME's order
    builtin: tuple[str, ...]        # built in, served here by our image
    custom: tuple[str, ...]         # an OpenEnv image named in ENV_<NAME>_IMAGE, served here
    external: dict[str, str]        # ENV_URLS: a server somewhere else (no service here)
    images: dict[str, str] = field(default_factory=dict)  # ENV_<NAME>_IMAGE as set in .env, by env name

    @property
    def served_here(self) -> tuple[str, ...]:
        """The envs that get a service here (built in or custom), in ENV_NAME's order."""
        return tuple(n for n in self.names if n in self.builtin or n in self.custom)


def env_kinds(values: dict[str, str]) -> EnvKinds:
    """ENV_NAME's names by kind; each is built in, has its image in ENV_<NAME>_IMAGE, or a server in ENV_URLS."""
    from envs import registry

    names = naming.parse_names(values.get("ENV_NAME", "echo"))
    try:
        naming.check_names(names, registry.names())
    except ValueError as exc:
        raise StackError(f"ENV_NAME: {exc}") from None
    try:
        urls = naming.parse_urls(values.get("ENV_URLS"))
    except ValueError as exc:
        raise StackError(f"ENV_URLS: {exc}") from None
    images = {n: values[naming.image_var(n)] for n in names if values.get(naming.image_var(n))}
    images = {n: i for n, i in images.items() if not (i == SHARED_IMAGE_BEFORE and registry.is_builtin(n))}
    for n in names:
        if not registry.is_builtin(n) and n not in images and n not in urls:
            raise StackError(
                f"ENV_NAME: {n!r} is not built in ({', '.join(registry.names())}): to train on any OpenEnv image, "
                f"set {naming.image_var(n)}=<image> in .env (or point ENV_URLS at a running server: "
                f"{n}=http://host:8000); or fix the name in .env"
            )
    return EnvKinds(
        names=tuple(names),
        builtin=tuple(n for n in names if registry.is_builtin(n) and n not in urls),
        custom=tuple(n for n in names if not registry.is_builtin(n) and n not in urls),
        external={n: u for n, u in urls.items() if n in names},
        images=images,
    )
