"""Remove containers, volumes (outputs, models, caches) and the images built here."""

from __future__ import annotations

from tools import docker_host
from tools.images import BUILT_HERE, image_of
from tools.prepare import prepare


def run(rest: list[str]) -> int:
    rc = prepare().compose("--profile", "*", "down", "--volumes", "--remove-orphans")
    # an image that is not here (never built) is no error: clean leaves nothing of ours, whatever was built
    docker_host.run(["docker", "image", "rm", "-f", *map(image_of, BUILT_HERE)], timeout=300)
    return rc
