"""Bake TRL's FlashAttention-3 tree-attention kernel into the GPU trainer image (#31, trainer/async_grpo/tree_attention.py).

Run at image build time with the Hub reachable and KERNELS_CACHE set; at run time `kernels` reads it from there with
HF_HUB_OFFLINE=1, and trainer/async_grpo/tree_attention.py uses it on a Hopper GPU. Loading the kernel's CUDA library may fail
on a build host without a GPU driver: the download is what matters, so this checks the cache, not the import. It
checks for the build that fits this image's torch and CUDA (`kernels`' variant name, e.g.
torch213-cxx11-cu130-x86_64-linux): with BAKE_FA3=1 and no such build on the Hub the image build fails here, loudly,
rather than shipping an image that silently falls back (without BAKE_FA3 the run uses FA2 or SDPA, logged in one line).
"""

import os
import platform
import sys
from pathlib import Path

REPO, VERSION = "kernels-community/flash-attn3", 1  # trl 1.16 packing._flash_attn (CUDA)


def build_variant() -> str | None:
    """The build folder `kernels` loads for this torch (its naming: torch<maj><min>-<abi>-cu<maj><min>-<arch>-<os>),
    or None for a torch without CUDA."""
    import torch

    if not torch.version.cuda:
        return None
    torch_ver = torch.__version__.split("+")[0].split(".")
    cuda_ver = torch.version.cuda.split(".")
    abi = "cxx11" if torch.compiled_with_cxx11_abi() else "cxx98"
    return (f"torch{torch_ver[0]}{torch_ver[1]}-{abi}-cu{cuda_ver[0]}{cuda_ver[1]}-{platform.machine()}-"
            f"{platform.system().lower()}")


def cached_builds(cache: Path) -> list[str]:
    """The build variants of REPO in the kernel cache (snapshots/<rev>/build/<variant>)."""
    return sorted({p.name for p in cache.glob(f"*--{REPO.replace('/', '--')}/snapshots/*/build/*") if p.is_dir()})


def main() -> int:
    cache = Path(os.environ["KERNELS_CACHE"])
    variant = build_variant()
    if variant is None:
        print("bake_fa3: this image's torch has no CUDA: FA3 cannot run here; build with BAKE_FA3=0", file=sys.stderr)
        return 1
    from kernels import get_kernel

    try:
        get_kernel(REPO, version=VERSION)
    except Exception as e:  # e.g. no libcuda.so.1 at build time: the files are downloaded before the import
        print(f"bake_fa3: {REPO} not loadable here ({type(e).__name__}: {e}); checking the cache", file=sys.stderr)
    builds = cached_builds(cache)
    if variant not in builds:
        print(f"bake_fa3: {REPO} v{VERSION} has no build for this image's torch/CUDA ({variant}; in {cache}: "
              f"{', '.join(builds) or 'nothing'}): build with BAKE_FA3=0 (tree attention then runs on FA2 or SDPA), "
              "or check the build's network access to the Hub", file=sys.stderr)
        return 1
    print(f"bake_fa3: {REPO} v{VERSION} build {variant} in {cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
