"""Bake TRL's FlashAttention-3 tree-attention kernel into the GPU trainer image (#31, trainer/run/tree_attention.py).

Run at image build time with the Hub reachable and KERNELS_CACHE set; at run time `kernels` reads it from there with
HF_HUB_OFFLINE=1, and trainer/run/tree_attention.py uses it on a Hopper GPU. Loading the kernel's CUDA library may fail
on a build host without a GPU driver: the download is what matters, so this checks the cache, not the import.
"""

import os
import sys
from pathlib import Path

REPO, VERSION = "kernels-community/flash-attn3", 1  # trl 1.16 packing._flash_attn (CUDA)


def main() -> int:
    cache = Path(os.environ["KERNELS_CACHE"])
    from kernels import get_kernel

    try:
        get_kernel(REPO, version=VERSION)
    except Exception as e:  # e.g. no libcuda.so.1 at build time: the files are downloaded before the import
        print(f"bake_fa3: {REPO} downloaded but not loadable here ({type(e).__name__}: {e})", file=sys.stderr)
    folders = [p for p in cache.glob("*--" + REPO.replace("/", "--")) if (p / "snapshots").is_dir()]
    if not folders:
        print(f"bake_fa3: {REPO} is not in {cache} after the download: the image would fall back to FA2/SDPA. "
              "Check the build's network access to the Hub, or build with BAKE_FA3=0.", file=sys.stderr)
        return 1
    print(f"bake_fa3: {REPO} v{VERSION} in {folders[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
